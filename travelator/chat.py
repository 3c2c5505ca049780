"""Chat conversations to prompt text: one path for ``LLM.chat`` and the server's chat routes.

A conversation is a list of OpenAI-style messages, ``{"role": ..., "content": ...}``, where
content is a string or a list of text parts (``{"type": "text", "text": ...}``, joined); only an
assistant turn may leave its content out (one that called tools: ``tool_calls``), and a tool
turn may name the call it answers (``tool_call_id``). ``template_messages`` checks them and puts
them in the form chat templates read; ``render_chat`` renders them with the model's template
(``Tokenizer.apply_chat_template``) or another one. The server validates its request bodies
with pydantic first, then comes here with the same dicts, so both paths render a conversation to
the same text; that text holds every special token it needs and is encoded with
``add_special_tokens=False``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import jinja2

if TYPE_CHECKING:
    from travelator.model.tokenizer import Tokenizer

ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)

# Variables render_chat sets itself: chat_template_kwargs may not name them.
_RESERVED_VARS = ("messages", "add_generation_prompt", "tools")


class ChatMessageError(ValueError):
    """A conversation that cannot be rendered; ``param`` names the field, as the server's 400
    does (``messages.2.content``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: content as one string (text parts joined, a
    null content as ""), tool calls' JSON arguments as objects (templates write them with
    ``tojson``); ``name`` and ``tool_call_id`` kept, and the reasoning of an assistant turn
    (``thinking``, ``reasoning_content``). ChatMessageError for a malformed one."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatMessageError(f"a conversation is a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatMessageError("a conversation needs at least one message")
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _template_message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages.{i}"
    if not isinstance(m, Mapping):
        raise ChatMessageError(f"{where}: a message is a dict with 'role' and 'content', not "
                               f"{type(m).__name__}", where)
    role = m.get("role")
    if role is None:
        raise ChatMessageError(f"{where}: the message has no 'role'", f"{where}.role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise ChatMessageError(f"{where}: unknown role {role!r}; a role is one of "
                               f"{', '.join(CHAT_ROLES)}", f"{where}.role")
    content = m.get("content")
    if content is None and role != "assistant":  # only an assistant turn (that called tools) may omit it
        missing = "has no 'content'" if "content" not in m else "has a null content"
        raise ChatMessageError(f"{where}: the {role} message {missing}; it needs a string or a "
                               "list of text parts", f"{where}.content")
    msg: dict[str, Any] = {"role": role, "content": _text(content, f"{where}.content")}
    msg.update(_string_fields(m, ("name", "tool_call_id"), where))
    if m.get("tool_calls"):
        msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    msg.update(_reasoning(m, msg, where))
    return msg


def _string_fields(m: Mapping[str, Any], keys: tuple[str, ...], where: str) -> dict[str, str]:
    """The message's ``keys`` that it sets (not null), each of which must be a string."""
    given = {}
    for key in keys:
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise ChatMessageError(f"{where}: {key!r} must be a string", f"{where}.{key}")
            given[key] = value
    return given


def _reasoning(m: Mapping[str, Any], msg: dict[str, Any], where: str) -> dict[str, str]:
    """An assistant turn's reasoning under both names templates read it by: ``thinking``
    (gpt-oss's) and ``reasoning_content`` (Qwen3's, and what the server answers with), each
    as given, the other from it when only one is given. Not ``thinking`` beside the content
    of a turn that called tools: gpt-oss's template refuses both there, and renders that
    content as the reasoning."""
    given = _string_fields(m, ("thinking", "reasoning_content"), where)
    if not given:
        return given
    text = given.get("thinking", given.get("reasoning_content"))
    out = {"reasoning_content": text, **given}
    if "thinking" in given or not (msg.get("tool_calls") and msg["content"]):
        out["thinking"] = given.get("thinking", text)
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = repr(kind) if kind is not None else f"{type(part).__name__} without a type"
                raise ChatMessageError(f"{where}.{j}: content parts of type {shown} are not "
                                       "supported (a part is {'type': 'text', 'text': ...})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise ChatMessageError(f"{where}: content is a string or a list of text parts, not "
                           f"{type(content).__name__}", where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls: arguments as an object where they are JSON text, as sent
    otherwise (OpenAI sends them as text)."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatMessageError(f"{where}: tool_calls is a list", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatMessageError(f"{where}.{j}: a tool call is {{'id': ..., 'type': 'function', "
                                   "'function': {'name': ..., 'arguments': ...}}", f"{where}.{j}")
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of one conversation through ``tokenizer``'s chat template (or
    ``chat_template``, a jinja source, instead), offering ``tools`` to templates that render
    them; ``chat_template_kwargs`` are more template variables.

    ``continue_final_message`` leaves the last message open (the text ends with its content,
    without the template's end of turn) for the model to continue it, as transformers does;
    it excludes ``add_generation_prompt``. ChatMessageError (a ValueError) for a malformed
    message or a template that refuses the conversation.
    """
    msgs = template_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ChatMessageError("continue_final_message continues the last message: give "
                               "add_generation_prompt=False with it")
    extra = dict(chat_template_kwargs or {})
    reserved = [k for k in _RESERVED_VARS if k in extra]
    if reserved:
        raise ChatMessageError(f"chat_template_kwargs may not set {', '.join(reserved)}: they "
                               "are arguments of their own")
    if tools:
        extra["tools"] = list(tools)
    if chat_template is not None:
        tokenizer = copy.copy(tokenizer)  # the same vocabulary and variables, another template
        tokenizer.chat_template = chat_template
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as exc:
        raise ChatMessageError(f"the chat template refused these messages: {exc}") from None
    if continue_final_message:
        final, last = msgs[-1]["content"], f"messages.{len(msgs) - 1}.content"
        if not final.strip():
            raise ChatMessageError("continue_final_message: the last message is empty, there is "
                                   "nothing to continue", last)
        end = text.rfind(final)
        if end < 0:  # templates that strip the content (Llama 3's)
            final = final.strip()
            end = text.rfind(final)
        if end < 0:
            raise ChatMessageError("continue_final_message: the last message's content is not in "
                                   "the rendered text, so it cannot be continued", last)
        text = text[: end + len(final)]
    return text
