"""Tool calling for chat completions: what a request offers and demands, the grammar that
forces a call, and reading the calls out of the model's text, whole or as it streams.

- ``tool_choice: "none"``: the tools are shown to the model (its chat template renders them)
  and its text is returned as content.
- ``"auto"``: the model writes what it likes; calls in its family's format are read out of the
  text: Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5 and
  others) or Llama 3's bare JSON ``{"name": ..., "parameters": {...}}``.
- ``"required"``: the output is constrained to a JSON array of calls
  ``[{"name": ..., "parameters": {...}}, ...]`` (one call when ``parallel_tool_calls`` is false),
  each matching its tool's parameter schema, so it always parses.
- a named function: the output is constrained to that function's arguments.

A call ended by ``max_tokens`` may be cut short; its text then stays in ``content``.
gpt-oss's answers ("auto" and "none") are read by harmony.py, with the same plan.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from travelator.server.errors import APIError
from travelator.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from travelator.strict_schema import close_objects

ToolCallFormat = Literal["hermes", "llama3_json"]
TOOL_CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3_json")

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template teaches its model: Hermes tags where the template has
    them, else Llama 3's JSON."""
    if chat_template and "<tool_call>" not in chat_template and (
            "<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools and what it demands of them."""
    tools: list[dict[str, Any]]  # as the chat template takes them (OpenAI's tool objects)
    mode: Literal["none", "auto", "required", "named"]
    named: str | None
    parallel: bool
    format: ToolCallFormat

    def offers(self, name: str) -> bool:
        return any(t["function"]["name"] == name for t in self.tools)

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match ("required" and named choices), else None."""
        params = {t["function"]["name"]: _arguments_schema(t["function"]) for t in self.tools}
        if self.mode == "named":
            return params[self.named]
        if self.mode != "required":
            return None
        calls, defs = [], {}
        for i, (name, schema) in enumerate(params.items()):
            schema, tool_defs = _lift_definitions(schema, f"tool{i}_")
            defs.update(tool_defs)
            calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                          "required": ["name", "parameters"], "additionalProperties": False})
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return array


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema; closed when the function is strict (strict_schema.py)."""
    schema = function.get("parameters") or _NO_ARGUMENTS
    return close_objects(schema) if function.get("strict") is True else schema


def _lift_definitions(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs``/``definitions``, its references rewritten to point at
    them under ``prefix`` in the root of the schema it is nested in; and those definitions. A
    reference to the schema itself (``#``) points at a copy of it among them."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    uses_root = False

    def rewrite(node: Any) -> Any:
        nonlocal uses_root
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    uses_root, out["$ref"] = True, f"#/$defs/{prefix}root"
                for old in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(old):
                        out["$ref"] = f"#/$defs/{prefix}{ref[len(old):]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    lifted = {f"{prefix}{name}": rewrite(d) for name, d in defs.items()}
    body = rewrite(body)
    if uses_root:
        lifted[f"{prefix}root"] = body
    return body, lifted


def plan_tools(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan | None:
    """The request's tool plan (None: no tools), or a 400 naming what is wrong."""
    return plan_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, fmt)


def plan_tool_use(tools: list[ChatTool] | None, choice: str | NamedToolChoice | None, parallel: bool,
                  fmt: ToolCallFormat) -> ToolPlan | None:
    """The plan of ``tools`` offered with ``choice`` (chat's fields; the Responses API's are
    converted to them), or a 400 naming ``tools`` or ``tool_choice``."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", param="tools")
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in names:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice")
        mode = "named"
    else:
        mode = choice or "auto"
    return ToolPlan(template_tools(tools), mode, named, parallel, fmt)


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """Tools as chat templates take them: OpenAI's tool objects."""
    return [t.model_dump(exclude_none=True) for t in tools]


def call_id() -> str:
    """A fresh id for a call the model made."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any, arguments_keys: tuple[str, ...]) -> FunctionCall | None:
    """``{"name": ..., <arguments key>: {...}}`` as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            return FunctionCall(name=obj["name"], arguments=args if isinstance(args, str) else json.dumps(args))
    return FunctionCall(name=obj["name"], arguments="{}")


@dataclass(slots=True)
class _ArrayObjects:
    """Finds the complete JSON objects directly inside a top-level array while its text
    grows, reading each character once."""
    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    start: int = -1

    def new_spans(self, text: str) -> list[tuple[int, int]]:
        spans = []
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                if ch == "{" and self.depth == 1:
                    self.start = i
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if ch == "}" and self.depth == 1:
                    spans.append((self.start, i + 1))
        self.pos = len(text)
        return spans


@dataclass(slots=True)
class ToolCallReader:
    """Reads one choice's text as it comes: ``feed`` each new piece, ``finish`` at the end.
    Both return (content to show, tool-call deltas to send). The whole answer of a choice is
    the same reader fed once."""
    plan: ToolPlan
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _array: _ArrayObjects = field(default_factory=_ArrayObjects)  # "required": the calls' array
    _json_mode: bool | None = None  # llama3_json: the text is a call (decided at its first character)
    _held_space: str = ""  # hermes: trailing whitespace not sent yet
    _after_call: bool = False  # hermes: whitespace after a call is dropped

    def _offered(self, call: FunctionCall) -> bool:
        return self.plan.offers(call.name)

    def _emit(self, call: FunctionCall) -> list[DeltaToolCall]:
        if self.calls and not self.plan.parallel:
            return []
        index = len(self.calls)
        self.calls.append(ToolCall(id=call_id(), function=call))
        return [DeltaToolCall(index=index, id=self.calls[-1].id, type="function",
                              function=DeltaFunctionCall(name=call.name, arguments=call.arguments))]

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        mode = self.plan.mode
        if mode == "none" or not text:
            return text, []
        if mode == "named":
            return self._feed_named(text)
        self._buffer += text
        if mode == "required":
            return "", self._scan_required()
        if self.plan.format == "hermes":
            return self._scan_hermes(final=False)
        return self._feed_llama3(final=False)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        mode = self.plan.mode
        if mode in ("none", "named"):
            return "", []
        if mode == "required":
            deltas = self._scan_required()
            rest = self._buffer if not self.calls else ""  # cut short before any call closed
            self._buffer = ""
            return rest, deltas
        if self.plan.format == "hermes":
            return self._scan_hermes(final=True)
        return self._feed_llama3(final=True)

    # -- the modes ---------------------------------------------------------------------
    def _feed_named(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        # The output is the arguments themselves: stream them as they come.
        if not self.calls:
            self.calls.append(ToolCall(id=call_id(), function=FunctionCall(name=self.plan.named, arguments=text)))
            return "", [DeltaToolCall(index=0, id=self.calls[0].id, type="function",
                                      function=DeltaFunctionCall(name=self.plan.named, arguments=text))]
        call = self.calls[0]
        call.function.arguments += text
        return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]

    def _scan_required(self) -> list[DeltaToolCall]:
        deltas = []
        for a, b in self._array.new_spans(self._buffer):
            call = _as_call(json.loads(self._buffer[a:b]), ("parameters", "arguments"))
            if call is not None:
                deltas += self._emit(call)
        return deltas

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _PYTHON_TAG = "<|python_tag|>"

    def _scan_hermes(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        content, deltas = [], []
        while self._buffer:
            start = self._buffer.find(self._OPEN)
            if start < 0:
                # Hold back a tail that may be the start of a tag still coming.
                keep = 0 if final else partial_suffix(self._buffer, self._OPEN)
                content.append(self._text(self._buffer[:len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._text(self._buffer[:start]))
            end = self._buffer.find(self._CLOSE, start)
            if end < 0 and not final:
                self._buffer = self._buffer[start:]
                break
            body = self._buffer[start + len(self._OPEN):end if end >= 0 else None]
            call = _parse_json_call(body, ("arguments", "parameters"))
            if call is None or not self._offered(call):  # not a call after all: it is text
                content.append(self._text(self._buffer[start:end + len(self._CLOSE) if end >= 0 else None]))
            else:
                self._held_space, self._after_call = "", True  # no blank around a call
                deltas += self._emit(call)
            self._buffer = self._buffer[end + len(self._CLOSE):] if end >= 0 else ""
        if final:
            content.append(self._held_space)
            self._held_space = ""
        return "".join(content), deltas

    def _text(self, text: str) -> str:
        """Content as it may be sent now: whitespace next to a call is not content, so a
        blank at the end is held until text follows it (or the output ends)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        return body

    def _feed_llama3(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        if self._json_mode is None:
            head = self._buffer.lstrip()
            if not final and (not head or self._PYTHON_TAG.startswith(head)):
                return "", []  # too early to tell
            self._json_mode = head.startswith(("{", self._PYTHON_TAG))
        if not self._json_mode:
            text, self._buffer = self._buffer, ""
            return text, []
        if not final:
            return "", []
        text, self._buffer = self._buffer, ""
        calls = _json_calls(text.strip().removeprefix(self._PYTHON_TAG))
        if not calls or not all(self._offered(c) for c in calls):  # an answer in JSON, not calls
            return text, []
        return "", [d for c in calls for d in self._emit(c)]


def _json_calls(body: str) -> list[FunctionCall]:
    """Llama 3's calls: JSON objects one after another (``;`` or blanks between); none when
    ``body`` is anything else."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = _as_call(obj, ("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_json_call(body: str, arguments_keys: tuple[str, ...]) -> FunctionCall | None:
    try:
        return _as_call(json.loads(body), arguments_keys)
    except json.JSONDecodeError:
        return None


def keeps_special_tokens(plan: ToolPlan | None, tool_tags_are_special: bool) -> bool:
    """Whether the answer's text must keep special tokens for the reader: Hermes tags that
    are special tokens would vanish from it."""
    return plan is not None and plan.mode == "auto" and plan.format == "hermes" and tool_tags_are_special


def finish_reason(plan: ToolPlan | None, reader: ToolCallReader | None, engine_reason: str | None) -> str | None:
    """``tool_calls`` when the model ended its turn by calling tools (auto or required); a
    named function keeps ``stop``, as OpenAI's API does."""
    if (plan is not None and reader is not None and reader.calls and plan.mode in ("auto", "required")
            and engine_reason == "stop"):
        return "tool_calls"
    return engine_reason

