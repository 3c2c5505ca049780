"""``POST /v1/responses``: the core of OpenAI's Responses API, text in and text out.

The input (a string, or a list of messages with string or ``input_text`` parts) and the
``instructions`` (a system message first) go through the chat template like a chat
completion; the answer is one ``message`` output item. Streaming sends the API's typed
events: ``response.created``, ``response.in_progress``, the item and content-part
``added`` events, one ``response.output_text.delta`` per token step, the ``done`` events and
``response.completed``. Nothing is stored (``store`` is accepted and ignored, so there is no
``GET /v1/responses/{id}`` and ``previous_response_id`` is refused); tools are refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from travelator.engine.outputs import RequestOutput
from travelator.server.chat import render_messages
from travelator.server.constraints import structured_outputs_spec
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.protocol import (
    ChatMessage,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
    now,
    random_id,
)
from travelator.server.serving import EnginePrompt, OpenAIServing
from travelator.server.streaming import event_stream, json_response
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class ResponseRun:
    gen: Generation
    req: ResponsesRequest
    model: str
    prompt: EnginePrompt
    created: int = field(default_factory=now)
    message_id: str = field(default_factory=lambda: random_id("msg"))

    def response(self, status: str, text: str = "", out: RequestOutput | None = None) -> ResponseObject:
        incomplete = out is not None and out.finish_reason == "length"
        usage = None
        if out is not None:
            n_in, n_out = len(self.prompt.token_ids), len(out.output_token_ids)
            usage = ResponseUsage(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out,
                                  input_tokens_details={"cached_tokens": out.num_cached_tokens},
                                  output_tokens_details={"reasoning_tokens": 0})
        final = "incomplete" if incomplete else status
        items = [] if status == "in_progress" else [ResponseOutputMessage(
            id=self.message_id, status=final, content=[ResponseOutputText(text=text)])]
        return ResponseObject(
            id=self.gen.id, created_at=self.created, status=final, model=self.model, output=items,
            usage=usage, incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            instructions=self.req.instructions, max_output_tokens=self.req.max_output_tokens,
            temperature=self.req.temperature, top_p=self.req.top_p, metadata=self.req.metadata or {})


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [ChatMessage(role="user", content=req.input)]
    for m in req.input:
        text = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        messages.append(ChatMessage(role=m.role, content=text))
    return messages


def _prepare(serving: OpenAIServing, req: ResponsesRequest, structured: StructuredOutput | None) -> ResponseRun:
    """Everything before the engine: rendered, tokenised, validated, not yet queued (a
    preprocessing worker)."""
    model = serving.resolve_model(req.model)
    if req.previous_response_id is not None:
        raise APIError(400, "responses are not stored here, so previous_response_id cannot be used; "
                            "send the whole conversation as input", param="previous_response_id")
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.n not in (None, 1):
        raise APIError(400, "a response has one output", param="n")
    text = render_messages(serving, _messages(req), add_generation_prompt=True)
    prompt = EnginePrompt(text, serving.tokenizer.encode(text, add_special_tokens=False))
    if not prompt.token_ids:
        raise APIError(400, "the input renders to an empty prompt", param="input")
    params = serving.sampling_params(req, req.max_output_tokens, None, structured=structured)
    gen = serving.prepare([prompt], params, req, "input", "resp")
    return ResponseRun(gen, req, model, prompt)


async def create_response(serving: OpenAIServing, req: ResponsesRequest, request: Request) -> Response:
    serving.resolve_model(req.model)  # a 404 before any compile
    structured = await serving.constraints.compile(structured_outputs_spec(req.structured_outputs))
    run = await serving.preprocessor.run(_prepare, serving, req, structured)
    serving.launch(run.gen)
    if req.stream:
        return event_stream(run.gen, _stream(run))
    finals = await serving.collect(request, run.gen, 1, lambda i, out: None)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return json_response(run.response("completed", finals[0].text, finals[0]))


def _event(kind: str, seq: int, **fields) -> str:
    body = {"type": kind, "sequence_number": seq, **{
        k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()}}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


async def _stream(run: ResponseRun) -> AsyncIterator[str]:
    seq = iter(range(1 << 62))
    item = dict(output_index=0, item_id=run.message_id)
    part = dict(item, content_index=0)
    yield _event("response.created", next(seq), response=run.response("in_progress"))
    yield _event("response.in_progress", next(seq), response=run.response("in_progress"))
    empty = ResponseOutputMessage(id=run.message_id, status="in_progress", content=[])
    yield _event("response.output_item.added", next(seq), output_index=0, item=empty)
    yield _event("response.content_part.added", next(seq), **part, part=ResponseOutputText(text=""))
    async for _, out in run.gen.outputs():
        if out.new_token_ids or out.new_text:  # one delta per token step, as chat streams
            yield _event("response.output_text.delta", next(seq), **part, delta=out.new_text, logprobs=[])
        if out.finished:
            final = run.response("completed", out.text, out)
            yield _event("response.output_text.done", next(seq), **part, text=out.text, logprobs=[])
            yield _event("response.content_part.done", next(seq), **part, part=ResponseOutputText(text=out.text))
            yield _event("response.output_item.done", next(seq), output_index=0, item=final.output[0])
            kind = "response.completed" if final.status == "completed" else "response.incomplete"
            yield _event(kind, next(seq), response=final)
