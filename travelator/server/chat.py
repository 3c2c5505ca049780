"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from travelator.chat import ChatMessageError, render_chat
from travelator.engine.outputs import RequestOutput
from travelator.server.constraints import constraint_spec
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
from travelator.server.tools import (
    ToolCallReader,
    ToolPlan,
    finish_reason,
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

    def tool_reader(self) -> ToolCallReader | None:
        """Reads one choice's tool calls, when tools may be called."""
        return ToolCallReader(self.tools) if self.tools is not None and self.tools.mode != "none" else None

    def logprobs(self, choice: int, out: RequestOutput) -> list[ChatTokenLogprob] | None:
        if self.texts is None:
            return None
        return chat_logprobs(self.texts[choice], out.new_logprobs, self.top_logprobs)

    def chunk(self, choices: list[ChatChunkChoice], totals: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.model,
                                       choices=choices, usage=totals))


def _prompt(serving: OpenAIServing, req: ChatCompletionRequest, tools: ToolPlan | None) -> EnginePrompt:
    text = render_messages(serving, req.messages, req.add_generation_prompt,
                           tools.tools if tools is not None else None)
    ids = serving.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages")
    return EnginePrompt(text, ids)


def render_messages(serving: OpenAIServing, chat_messages: list[ChatMessage],
                    add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The prompt text of ``chat_messages`` (and of the ``tools`` offered, for templates that
    render them) through the model's chat template (also what ``POST /tokenize`` encodes for
    a chat body): travelator.chat's rendering, the same as ``LLM.chat``'s."""
    try:
        return render_chat(serving.tokenizer, [m.model_dump(exclude_none=True) for m in chat_messages],
                           add_generation_prompt=add_generation_prompt, tools=tools)
    except ChatMessageError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _start(serving: OpenAIServing, req: ChatCompletionRequest, tools: ToolPlan | None,
           structured: StructuredOutput | None) -> ChatRun:
    model = serving.resolve_model(req.model)
    prompt = _prompt(serving, req, tools)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    params = serving.sampling_params(req, max_tokens, top_n if req.logprobs else None, structured=structured)
    if tools is not None and tools.mode == "auto" and tools.format == "hermes" and serving.tool_tags_are_special:
        params.skip_special_tokens = False  # the tags must reach the reader
    gen = serving.start([prompt], params, req, "messages", "chatcmpl")
    texts = None
    if req.logprobs:
        texts = [TokenTexts(serving.tokenizer, prompt.token_ids, params.skip_special_tokens)
                 for _ in range(params.n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRun(gen, model, now(), prompt, params.n, texts, top_n, include_usage, tools)


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    serving.resolve_model(req.model)  # a 404 before any compile
    tools = plan_tools(req, serving.tool_call_format)
    run = _start(serving, req, tools, await serving.constraints.compile(
        constraint_spec(req, tools.forced_schema() if tools is not None else None)))
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
        content, calls, reason = out.text, [], out.finish_reason
        reader = run.tool_reader()
        if reader is not None:
            content = reader.feed(out.text)[0] + reader.finish()[0]
            calls, reason = reader.calls, finish_reason(run.tools, reader, out.finish_reason)
            if calls and not content:
                content = None
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(content=content, tool_calls=calls or None),
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
    readers = [run.tool_reader() for _ in range(run.n)]
    async for i, out in run.gen.outputs():
        lp = run.logprobs(i, out)
        reader = readers[i]
        content, calls = reader.feed(out.new_text) if reader is not None else (out.new_text, [])
        # One chunk per token step, as vLLM; with tools, only chunks that carry something.
        if (out.new_token_ids and reader is None) or content or calls or lp:
            yield run.chunk([ChatChunkChoice(
                index=i, delta=DeltaMessage(content=content if reader is None or content else None,
                                            tool_calls=calls or None),
                logprobs=ChatLogprobs(content=lp) if lp is not None else None)])
        if out.finished:
            finals[i] = out
            reason = out.finish_reason
            if reader is not None:
                content, calls = reader.finish()
                if content or calls:
                    yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(
                        content=content or None, tool_calls=calls or None))])
                reason = finish_reason(run.tools, reader, out.finish_reason)
            yield run.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=reason,
                                             stop_reason=out.stop_reason)])
    if run.include_usage:
        yield run.chunk([], usage([run.prompt], finals, run.n))
