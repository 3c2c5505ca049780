"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated;
the answer read for tool calls (tools.py) or, from a model that answers in harmony, for its
channels (harmony.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from travelator.chat import ChatMessageError, render_chat
from travelator.engine.outputs import RequestOutput
from travelator.server.constraints import constraint_spec
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.harmony import HarmonyDelta, HarmonyReader
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
from travelator.server.tools import (
    ToolCallReader,
    ToolPlan,
    finish_reason,
    keeps_special_tokens,
    plan_tools,
)
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
    tools: ToolPlan | None
    harmony: bool  # the answers are read for harmony's channels

    def reader(self) -> HarmonyReader | ToolCallReader | None:
        """Reads one choice's answer: its channels, or its tool calls when tools may be called."""
        if self.harmony:
            return HarmonyReader(self.tools)
        return ToolCallReader(self.tools) if self.tools is not None and self.tools.mode != "none" else None

    def logprobs(self, choice: int, out: RequestOutput) -> list[ChatTokenLogprob] | None:
        if self.texts is None:
            return None
        return chat_logprobs(self.texts[choice], out.new_logprobs, self.top_logprobs)

    def chunk(self, choices: list[ChatChunkChoice], totals: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.model,
                                       choices=choices, usage=totals))


def _read(reader: HarmonyReader | ToolCallReader, text: str | None, engine_reason: str | None = None) -> HarmonyDelta:
    """What a piece of a choice's text adds to its message (``text`` None: the end of the
    answer, which ``engine_reason`` ended)."""
    if isinstance(reader, HarmonyReader):
        return reader.feed(text) if text is not None else reader.finish(complete=engine_reason == "stop")
    content, calls = reader.feed(text) if text is not None else reader.finish()
    return HarmonyDelta(content=content, tool_calls=calls)


def _prompt(serving: OpenAIServing, req: ChatCompletionRequest, tools: ToolPlan | None) -> EnginePrompt:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    text = render_messages(serving, req.messages, req.add_generation_prompt,
                           tools.tools if tools is not None else None, kwargs)
    ids = serving.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages")
    return EnginePrompt(text, ids)


def render_messages(serving: OpenAIServing, chat_messages: list[ChatMessage],
                    add_generation_prompt: bool, tools: list[dict] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of ``chat_messages`` (and of the ``tools`` offered, for templates that
    render them; ``chat_template_kwargs``: more template variables) through the model's chat
    template (also what ``POST /tokenize`` encodes for a chat body): travelator.chat's
    rendering, the same as ``LLM.chat``'s."""
    try:
        return render_chat(serving.tokenizer, [m.model_dump(exclude_none=True) for m in chat_messages],
                           add_generation_prompt=add_generation_prompt, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
    except ChatMessageError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _prepare(serving: OpenAIServing, req: ChatCompletionRequest, tools: ToolPlan | None,
             structured: StructuredOutput | None) -> ChatRun:
    """Everything before the engine: rendered, tokenised, validated, not yet queued (a
    preprocessing worker)."""
    model = serving.resolve_model(req.model)
    prompt = _prompt(serving, req, tools)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    params = serving.sampling_params(req, max_tokens, top_n if req.logprobs else None, structured=structured)
    if keeps_special_tokens(tools, serving.tool_tags_are_special):
        params.skip_special_tokens = False  # the tags must reach the reader
    # A forced call is constrained to bare JSON, read as other models' are.
    harmony = serving.harmony if tools is None or tools.mode in ("none", "auto") else None
    if harmony is not None:
        params.skip_special_tokens = False  # the structural tokens must reach the reader
        if not req.ignore_eos:
            added = [t for t in harmony.stop_token_ids if t not in params.stop_token_ids]
            params.stop_token_ids += added
            # The server's own stop tokens do not count against the client's limit.
            limits = params.stop_limits
            params.stop_limits = replace(limits, max_stop_token_ids=limits.max_stop_token_ids + len(added))
    gen = serving.prepare([prompt], params, req, "messages", "chatcmpl")
    texts = None
    if req.logprobs:
        texts = [TokenTexts(serving.tokenizer, prompt.token_ids, params.skip_special_tokens)
                 for _ in range(params.n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRun(gen, model, now(), prompt, params.n, texts, top_n, include_usage, tools,
                   harmony is not None)


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    serving.resolve_model(req.model)  # a 404 before any compile
    tools = plan_tools(req, serving.tool_call_format)
    structured = await serving.constraints.compile(
        constraint_spec(req, tools.forced_schema() if tools is not None else None))
    run = await serving.preprocessor.run(_prepare, serving, req, tools, structured)
    serving.launch(run.gen)
    if req.stream:
        return event_stream(run.gen, _stream(run))
    lps: list[list[ChatTokenLogprob]] = [[] for _ in range(run.n)]

    def on_output(i: int, out: RequestOutput) -> None:
        lps[i].extend(run.logprobs(i, out) or [])

    finals = await serving.collect(request, run.gen, run.n, on_output)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(finals):
        content, reasoning, calls, reason = out.text, "", [], out.finish_reason
        reader = run.reader()
        if reader is not None:
            whole, rest = _read(reader, out.text), _read(reader, None, out.finish_reason)
            content, reasoning = whole.content + rest.content, whole.reasoning + rest.reasoning
            calls, reason = reader.calls, finish_reason(run.tools, reader, out.finish_reason)
            if (calls or reasoning) and not content:
                content = None
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(content=content, tool_calls=calls or None,
                                              reasoning_content=reasoning or None),
            logprobs=ChatLogprobs(content=lps[i]) if run.texts is not None else None,
            finish_reason=reason, stop_reason=out.stop_reason))
    return json_response(ChatCompletionResponse(
        id=run.gen.id, created=run.created, model=run.model, choices=choices,
        usage=usage([run.prompt], finals, run.n)))


async def _stream(run: ChatRun) -> AsyncIterator[str]:
    """A first chunk with the role per choice, content (and tool-call) deltas, a last chunk
    with the finish reason per choice, and the usage when asked for."""
    for i in range(run.n):
        yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    finals: list[RequestOutput | None] = [None] * run.n
    readers = [run.reader() for _ in range(run.n)]
    async for i, out in run.gen.outputs():
        lp = run.logprobs(i, out)
        reader = readers[i]
        piece = _read(reader, out.new_text) if reader is not None else HarmonyDelta(content=out.new_text)
        # One chunk per token step, as vLLM; with tools read out of the text, only chunks
        # that carry something.
        per_step = not isinstance(reader, ToolCallReader)
        if (out.new_token_ids and per_step) or _carries(piece) or lp:
            yield run.chunk([ChatChunkChoice(
                index=i, delta=_delta(piece, empty_content=per_step),
                logprobs=ChatLogprobs(content=lp) if lp is not None else None)])
        if out.finished:
            finals[i] = out
            reason = out.finish_reason
            if reader is not None:
                rest = _read(reader, None, out.finish_reason)
                if _carries(rest):
                    yield run.chunk([ChatChunkChoice(index=i, delta=_delta(rest, empty_content=False))])
                reason = finish_reason(run.tools, reader, out.finish_reason)
            yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=reason,
                                             stop_reason=out.stop_reason)])
    if run.include_usage:
        yield run.chunk([], usage([run.prompt], finals, run.n))


def _carries(piece: HarmonyDelta) -> bool:
    return bool(piece.content or piece.reasoning or piece.tool_calls)


def _delta(piece: HarmonyDelta, empty_content: bool) -> DeltaMessage:
    """A chunk's delta; ``empty_content``: an empty content is sent as "" (a token step that
    showed nothing yet), not left out."""
    content = piece.content if piece.content or (empty_content and not _carries(piece)) else None
    return DeltaMessage(content=content, reasoning_content=piece.reasoning or None,
                        tool_calls=piece.tool_calls or None)
