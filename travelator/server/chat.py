"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import Response

from travelator.engine.outputs import RequestOutput
from travelator.errors import InvalidRequestError
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.logprobs import TokenTexts, chat_logprobs
from travelator.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    Usage,
    now,
)
from travelator.server.serving import EnginePrompt, OpenAIServing, usage
from travelator.server.streaming import event_stream, json_response, sse
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class ChatRun:
    """One chat request under way: what its answer needs besides the engine's outputs."""

    gen: Generation
    model: str
    created: int
    prompt: EnginePrompt
    n: int
    texts: list[TokenTexts] | None  # per choice, when logprobs were asked for
    top_logprobs: int
    include_usage: bool

    def logprobs(self, choice: int, out: RequestOutput) -> list[ChatTokenLogprob] | None:
        if self.texts is None:
            return None
        return chat_logprobs(self.texts[choice], out.new_logprobs, self.top_logprobs)

    def chunk(self, choices: list[ChatChunkChoice], totals: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.model,
                                       choices=choices, usage=totals))


def _prompt(serving: OpenAIServing, req: ChatCompletionRequest) -> EnginePrompt:
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    text = render_messages(serving, req.messages, req.add_generation_prompt)
    ids = serving.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages")
    return EnginePrompt(text, ids)


def render_messages(serving: OpenAIServing, chat_messages: list[ChatMessage],
                    add_generation_prompt: bool) -> str:
    """The prompt text of ``chat_messages`` through the model's chat template (also what
    ``POST /tokenize`` encodes for a chat body)."""
    messages = []
    for i, m in enumerate(chat_messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content parts of type {part.type!r} are not supported",
                                   param=f"messages.{i}.content")
                parts.append(part.text)
            content = "".join(parts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    try:
        return serving.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None


def _response_format(fmt: dict | None) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema (its
    ``schema``, strict or not: the output always matches it here)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutput(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                               param="response_format.json_schema")
            return StructuredOutput(json=spec.get("schema", {}))
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="response_format") from None
    raise APIError(400, f"response_format {kind!r} is not supported (text, json_object, json_schema)",
                   param="response_format")


def _start(serving: OpenAIServing, req: ChatCompletionRequest) -> ChatRun:
    model = serving.resolve_model(req.model)
    prompt = _prompt(serving, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    params = serving.sampling_params(req, max_tokens, top_n if req.logprobs else None,
                                     structured=_response_format(req.response_format))
    gen = serving.start([prompt], params, req, "messages", "chatcmpl")
    texts = None
    if req.logprobs:
        texts = [TokenTexts(serving.tokenizer, prompt.token_ids, params.skip_special_tokens)
                 for _ in range(params.n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRun(gen, model, now(), prompt, params.n, texts, top_n, include_usage)


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    run = _start(serving, req)
    if req.stream:
        return event_stream(run.gen, _stream(run))
    lps: list[list[ChatTokenLogprob]] = [[] for _ in range(run.n)]

    def on_output(i: int, out: RequestOutput) -> None:
        lps[i].extend(run.logprobs(i, out) or [])

    finals = await serving.collect(request, run.gen, run.n, on_output)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = [
        ChatChoice(index=i, message=AssistantMessage(content=out.text),
                   logprobs=ChatLogprobs(content=lps[i]) if run.texts is not None else None,
                   finish_reason=out.finish_reason, stop_reason=out.stop_reason)
        for i, out in enumerate(finals)
    ]
    return json_response(ChatCompletionResponse(
        id=run.gen.id, created=run.created, model=run.model, choices=choices,
        usage=usage([run.prompt], finals, run.n)))


async def _stream(run: ChatRun) -> AsyncIterator[str]:
    """A first chunk with the role per choice, content deltas, a last chunk with the finish
    reason per choice, and the usage when asked for."""
    for i in range(run.n):
        yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    finals: list[RequestOutput | None] = [None] * run.n
    async for i, out in run.gen.outputs():
        lp = run.logprobs(i, out)
        if out.new_token_ids or out.new_text or lp:  # one chunk per token step, as vLLM
            yield run.chunk([ChatChunkChoice(
                index=i, delta=DeltaMessage(content=out.new_text),
                logprobs=ChatLogprobs(content=lp) if lp is not None else None)])
        if out.finished:
            finals[i] = out
            yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=out.finish_reason,
                                             stop_reason=out.stop_reason)])
    if run.include_usage:
        yield run.chunk([], usage([run.prompt], finals, run.n))
