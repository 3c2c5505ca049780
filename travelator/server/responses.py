"""``/v1/responses``: OpenAI's Responses API over the chat machinery.

The input items (and ``instructions``, a system message first; and, with
``previous_response_id``, the stored conversation before them) become chat messages rendered
by the chat template (responses_input.py); function tools are chat's tool plans, forced calls
are constrained and calls are read out of the text by tools.py's reader, as on chat
completions. The answer is a ``message`` item and one ``function_call`` item per call
(responses_output.py). Streaming sends the API's typed events, numbered. With ``store`` (the
default) the response is kept (response_store.py) for ``GET``, ``DELETE`` and follow-ups.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from travelator.engine.outputs import RequestOutput
from travelator.server.chat import render_messages
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.protocol import now
from travelator.server.response_store import ResponseStore, StoredResponse
from travelator.server.responses_input import chat_messages, constraint, input_items, tool_plan
from travelator.server.responses_output import Event, OutputItems
from travelator.server.responses_protocol import (
    DeletedResponse,
    InputItem,
    ItemStatus,
    OutputItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from travelator.server.serving import EnginePrompt, OpenAIServing
from travelator.server.streaming import event_stream, json_response
from travelator.server.tools import ToolCallReader, ToolPlan, keeps_special_tokens
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class ResponseRun:
    gen: Generation
    req: ResponsesRequest
    model: str
    prompt: EnginePrompt
    plan: ToolPlan | None
    conversation: list[InputItem]  # every input item, those of the previous responses first
    created: int = field(default_factory=now)

    def reader(self) -> ToolCallReader | None:
        return ToolCallReader(self.plan) if self.plan is not None and self.plan.mode != "none" else None

    def response(self, status: ItemStatus, output: list[OutputItem], out: RequestOutput | None = None) -> ResponseObject:
        usage = None
        if out is not None:
            n_in, n_out = len(self.prompt.token_ids), len(out.output_token_ids)
            usage = ResponseUsage(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out,
                                  input_tokens_details={"cached_tokens": out.num_cached_tokens,
                                                        # The prefix cache keeps blocks on its own: no explicit writes.
                                                        "cache_write_tokens": 0},
                                  output_tokens_details={"reasoning_tokens": 0})
        req = self.req
        choice = req.tool_choice or ("auto" if req.tools else "none")
        text = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)} if (
            req.text is not None and req.text.format is not None) else {"format": {"type": "text"}}
        return ResponseObject(
            id=self.gen.id, created_at=self.created, status=status, model=self.model, output=output,
            usage=usage, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls,
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []], text=text,
            previous_response_id=req.previous_response_id, store=req.store)

    def read(self, items: OutputItems, reader: ToolCallReader | None, text: str,
             every_step: bool = False) -> list[Event]:
        """``text``, the answer's next piece, into ``items``."""
        if reader is None:
            return items.add(text, [], every_step)
        content, calls = reader.feed(text)
        return items.add(content, calls)

    def finish(self, items: OutputItems, reader: ToolCallReader | None,
               out: RequestOutput) -> tuple[ResponseObject, list[Event]]:
        """The finished response, and the events that end its items."""
        events = items.add(*reader.finish()) if reader is not None else []
        status: ItemStatus = "incomplete" if out.finish_reason == "length" else "completed"
        output, closing = items.close(status)
        return self.response(status, output, out), events + closing


def _prepare(serving: OpenAIServing, req: ResponsesRequest, history: list[InputItem],
             plan: ToolPlan | None, structured: StructuredOutput | None) -> ResponseRun:
    """Everything before the engine: rendered, tokenised, validated, not yet queued (a
    preprocessing worker)."""
    model = serving.resolve_model(req.model)
    if req.n not in (None, 1):
        raise APIError(400, "a response has one output", param="n")
    conversation = history + input_items(req)
    messages = chat_messages(req.instructions, conversation, first_new=len(history))
    text = render_messages(serving, messages, add_generation_prompt=True,
                           tools=plan.tools if plan is not None else None)
    prompt = EnginePrompt(text, serving.tokenizer.encode(text, add_special_tokens=False))
    if not prompt.token_ids:
        raise APIError(400, "the input renders to an empty prompt", param="input")
    params = serving.sampling_params(req, req.max_output_tokens, None, structured=structured)
    if keeps_special_tokens(plan, serving.tool_tags_are_special):
        params.skip_special_tokens = False  # the tags must reach the reader
    gen = serving.prepare([prompt], params, req, "input", "resp")
    return ResponseRun(gen, req, model, prompt, plan, conversation)


def stored_or_404(store: ResponseStore, response_id: str, param: str | None = None) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response has the id {response_id!r} (never stored, deleted, "
                            "evicted or expired)", param=param,
                       code="previous_response_not_found" if param else "not_found")
    return entry


async def create_response(serving: OpenAIServing, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Response:
    serving.resolve_model(req.model)  # a 404 before any compile
    history: list[InputItem] = []
    if req.previous_response_id is not None:
        history = stored_or_404(store, req.previous_response_id, "previous_response_id").conversation
    plan = tool_plan(req, serving.tool_call_format)
    structured = await serving.constraints.compile(constraint(req, plan))
    run = await serving.preprocessor.run(_prepare, serving, req, history, plan, structured)
    serving.launch(run.gen)

    def keep(response: ResponseObject) -> None:
        if req.store:
            store.keep(response, run.conversation)

    if req.stream:
        return event_stream(run.gen, _stream(run, keep))
    finals = await serving.collect(request, run.gen, 1, lambda i, out: None)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    items, reader = OutputItems(), run.reader()
    run.read(items, reader, finals[0].text)
    response, _ = run.finish(items, reader, finals[0])
    keep(response)
    return json_response(response)


def get_response(store: ResponseStore, response_id: str) -> Response:
    return json_response(stored_or_404(store, response_id).response)


def delete_response(store: ResponseStore, response_id: str) -> Response:
    stored_or_404(store, response_id)
    store.delete(response_id)
    return json_response(DeletedResponse(id=response_id))


def _event(kind: str, seq: int, fields: dict) -> str:
    body = {"type": kind, "sequence_number": seq, **{
        k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()}}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


async def _stream(run: ResponseRun, keep: Callable[[ResponseObject], None]) -> AsyncIterator[str]:
    """created, in_progress, the items' added / delta / done events as the text comes, then
    completed (or incomplete, at max_output_tokens)."""
    seq = iter(range(1 << 62))
    start = run.response("in_progress", [])
    yield _event("response.created", next(seq), {"response": start})
    yield _event("response.in_progress", next(seq), {"response": start})
    items, reader = OutputItems(), run.reader()
    # A text answer opens its message at once and sends a delta per token step, as chat does.
    events = items.open_message() if reader is None else []
    async for _, out in run.gen.outputs():
        if out.new_token_ids or out.new_text:
            events += run.read(items, reader, out.new_text, every_step=True)
        if out.finished:
            final, closing = run.finish(items, reader, out)
            keep(final)
            kind = "response.completed" if final.status == "completed" else "response.incomplete"
            events += closing + [(kind, {"response": final})]
        for kind, fields in events:
            yield _event(kind, next(seq), fields)
        events = []
