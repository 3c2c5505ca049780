"""The OpenAI endpoints over an AsyncEngine: request -> sub-requests -> responses or SSE chunks.

One HTTP request becomes ``len(prompts) * n`` engine requests (choice ``i * n + j`` is
choice ``j`` of prompt ``i``; seeded choices use ``seed + j``, like the offline API). They
are validated before any is queued, and aborted together when the client goes away, when
the response stream is closed, or when the handler is cancelled.

Everything here runs on the event loop thread and touches the engine only through
``AsyncEngine`` (adds and aborts go through its command queue) and through reads
(``make_request`` validates and tokenises without changing engine state; queue lengths).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import anyio
import jinja2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from travelator.engine.async_engine import AsyncEngine, EngineDeadError
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.sampling_params import SamplingParams
from travelator.server.errors import APIError
from travelator.server.metrics import ServerMetrics
from travelator.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
    now,
    random_id,
)
from travelator.server.settings import ServerSettings

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


# ---------------------------------------------------------------------------- sub-requests


@dataclass(slots=True)
class _Prompt:
    text: str | None  # as the client gave it, when it was text
    token_ids: list[int]


class Generation:
    """The engine requests of one HTTP request, read as one merged stream."""

    def __init__(self, async_engine: AsyncEngine, base_id: str,
                 subs: list[tuple[list[int], SamplingParams]], priority: int) -> None:
        self.async_engine = async_engine
        self.request_ids = [f"{base_id}-{i}" for i in range(len(subs))]
        self._subs = subs
        self._priority = priority
        self._queues: list[asyncio.Queue] = []
        self._getters: dict[asyncio.Future, int] = {}
        self.closed = False

    def start(self) -> None:
        try:
            for rid, (ids, params) in zip(self.request_ids, self._subs):
                _, queue = self.async_engine.add_request(ids, params, rid, self._priority)
                self._queues.append(queue)
        except BaseException:
            self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as steps produce them, until every choice has finished."""
        if len(self._queues) == 1:
            queue = self._queues[0]
            while True:
                out = _check(await queue.get())
                yield 0, out
                if out.finished:
                    return
        getters = self._getters
        for i, queue in enumerate(self._queues):
            getters[asyncio.ensure_future(queue.get())] = i
        while getters:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=getters.__getitem__):
                i = getters.pop(fut)
                out = _check(fut.result())
                if not out.finished:
                    getters[asyncio.ensure_future(self._queues[i].get())] = i
                yield i, out

    def close(self) -> None:
        """Abort whatever has not finished (a no-op for finished requests); idempotent."""
        if self.closed:
            return
        self.closed = True
        for fut in self._getters:
            fut.cancel()
        self._getters.clear()
        for rid in self.request_ids:
            self.async_engine.abort(rid)


def _check(item) -> RequestOutput:
    if isinstance(item, ValueError):
        raise APIError(400, str(item))
    if isinstance(item, BaseException):
        raise EngineDeadError(f"the engine has stopped: {item!r}")
    if item.finish_reason == "error":
        raise APIError(500, f"the engine failed this request: {item.error}", code="engine_error")
    return item


# ---------------------------------------------------------------------------- token texts


class _TokenTexts:
    """The text each token adds, decoded in context (a short window of the ids before it)."""

    _WINDOW = 6

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context[-self._WINDOW:])

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _piece(self, window: list[int], prev: str, token_id: int) -> str:
        cur = self._decode(window + [token_id])
        if cur.startswith(prev):
            return cur[len(prev):]
        return self._decode([token_id])

    def push(self, token_id: int, alternatives=()) -> tuple[str, list[tuple[str, float]]]:
        window = self._ids[-self._WINDOW:]
        prev = self._decode(window)
        text = self._piece(window, prev, token_id)
        alts = [(self._piece(window, prev, t), lp) for t, lp in alternatives]
        self._ids = window + [token_id]
        return text, alts


def _top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])


class _CompletionLogprobs:
    """Builds the legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, texts: _TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def prompt(self, token_ids: list[int]) -> CompletionLogprobs:
        # Prompt logprobs are not computed by the engine: echoed tokens carry null.
        res = CompletionLogprobs()
        for tid in token_ids:
            text, _ = self.texts.push(tid)
            res.tokens.append(text)
            res.token_logprobs.append(None)
            res.top_logprobs.append(None)
            res.text_offset.append(self.offset)
            self.offset += len(text)
        return res

    def add(self, logprobs: list[TokenLogprob], into: CompletionLogprobs | None = None) -> CompletionLogprobs:
        res = into or CompletionLogprobs()
        for lp in logprobs:
            top = _top(lp)
            text, alts = self.texts.push(lp.token_id, top)
            tops = dict(alts)
            tops.setdefault(text, lp.logprob)
            res.tokens.append(text)
            res.token_logprobs.append(lp.logprob)
            res.top_logprobs.append(tops)
            res.text_offset.append(self.offset)
            self.offset += len(text)
        return res


def _chat_logprobs(texts: _TokenTexts, logprobs: list[TokenLogprob], top_n: int) -> list[ChatTokenLogprob]:
    res = []
    for lp in logprobs:
        text, alts = texts.push(lp.token_id, _top(lp)[:top_n])
        res.append(ChatTokenLogprob(
            token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8"))) for t, v in alts],
        ))
    return res


# ---------------------------------------------------------------------------- streaming


class EventStream(StreamingResponse):
    """A server-sent-event stream that notices a client going away even between events.

    It listens for ``http.disconnect`` while streaming (whatever the ASGI spec version), so a
    request still waiting for its first token is aborted as soon as its client goes; and it
    always closes the body iterator, whose ``finally`` aborts the engine requests.
    """

    def __init__(self, content, **kw) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def run_stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the client went away mid-write
                    pass
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(run_stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def _json(model) -> Response:
    # pydantic writes a non-finite float (a -inf logprob) as null, where json.dumps would fail.
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _guarded_sse(gen: "Generation", events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Relay a response's SSE events and end them with ``[DONE]``.

    An error ends the stream with an error event instead of a broken connection; the
    generation is closed (its unfinished requests aborted) however the stream ends.
    """
    try:
        async for event in events:
            yield event
    except (APIError, EngineDeadError) as exc:
        yield _sse_error(exc)
    except Exception as exc:  # a bug: still a well-formed end of stream
        logger.exception("streaming failed")
        yield _sse_error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


def _sse_error(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else APIError(500, str(exc), code="engine_dead")
    return f"data: {err.body().model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Callable[[], object]):
    """Run ``work()`` (a coroutine function); cancel it if the client disconnects first.

    Returns (finished, result)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return True, task.result()
        return False, None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


# ---------------------------------------------------------------------------- the endpoints


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics,
                 served_model_names: list[str]) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.settings = settings
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- shared checks --------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return name or self.served_model_names[0]
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_model_names)}",
                       param="model", code="model_not_found")

    def _admit(self, count: int) -> None:
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           code="shutting_down")
        if not self.async_engine.healthy:
            self.metrics.rejected("engine_dead")
            raise APIError(503, f"the engine has stopped: {self.async_engine.error!r}", code="engine_dead")
        # In flight but not running = waiting (or just handed over and about to be scheduled).
        waiting = max(0, self.async_engine.num_in_flight - self.engine.num_running)
        limit = self.settings.max_waiting
        if waiting >= limit:
            self.metrics.rejected("queue_full")
            raise APIError(503, f"the server is overloaded: {waiting} requests are already waiting "
                                f"(limit {limit}, --max-waiting); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    def _sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        n = 1 if req.n is None else req.n
        if n > self.settings.max_n:
            raise APIError(400, f"n is {n}, more than this server's limit of {self.settings.max_n}", param="n")
        kw = dict(
            n=n, max_tokens=max_tokens, seed=req.seed, logprobs=logprobs,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as exc:
            first = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=first if first in _SAMPLING_FIELDS else None) from None

    def _validate_prompt(self, ids: list[int], params: SamplingParams, prompt_param: str) -> None:
        try:
            self.engine.make_request(ids, params, request_id="validate")
        except ValueError as exc:
            msg = str(exc)
            if len(ids) >= self.engine.max_model_len or "max_tokens" in msg:
                param = "max_tokens" if len(ids) < self.engine.max_model_len else prompt_param
                raise APIError(400, msg, param=param, code="context_length_exceeded") from None
            raise APIError(400, msg, param=prompt_param) from None

    def _start(self, prompts: list[_Prompt], params: SamplingParams, priority: int,
               prompt_param: str, prefix: str) -> Generation:
        n = params.n
        if len(prompts) * n > self.settings.max_choices_per_request:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than this server's limit of "
                                f"{self.settings.max_choices_per_request} choices per request", param="n")
        sub0 = replace(params, n=1)
        for p in prompts:
            self._validate_prompt(p.token_ids, sub0, prompt_param)
        self._admit(len(prompts) * n)
        subs = [(p.token_ids, _sub_params(params, j)) for p in prompts for j in range(n)]
        gen = Generation(self.async_engine, random_id(prefix), subs, priority)
        try:
            gen.start()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return gen

    def _usage(self, prompts: list[_Prompt], finals: list[RequestOutput], n: int) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(len(o.output_token_ids) for o in finals)
        cached = sum(finals[i * n].num_cached_tokens for i in range(len(prompts)))
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def _collect(self, request: Request, gen: Generation, k: int, on_output=None):
        async def run():
            finals: list[RequestOutput | None] = [None] * k
            async for i, out in gen.outputs():
                if on_output is not None:
                    on_output(i, out)
                if out.finished:
                    finals[i] = out
            return finals

        finished, finals = await _unless_disconnected(request, run)
        return finals if finished else None

    # ---- /v1/completions --------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[_Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "the prompt is empty", param="prompt")
                prompts.append(_Prompt(p, self.tokenizer.encode(p)))
            else:
                prompts.append(_Prompt(None, list(p)))
        return prompts

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        model = self.resolve_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        prompts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # the OpenAI default
        params = self._sampling_params(req, max_tokens, req.logprobs)
        n = params.n
        k = len(prompts) * n
        gen = self._start(prompts, params, req.priority, "prompt", "cmpl")
        created = now()
        want_lp = req.logprobs is not None

        def echo_text(i: int) -> str:
            p = prompts[i // n]
            return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

        builders = []
        if want_lp:
            for i in range(k):
                ids = prompts[i // n].token_ids
                b = _CompletionLogprobs(_TokenTexts(self.tokenizer, [] if req.echo else ids,
                                                    params.skip_special_tokens))
                builders.append(b)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream_completion(gen, model, created, prompts, n, k, req.echo,
                                             echo_text, builders, include_usage)
            return EventStream(_guarded_sse(gen, events))

        lps = [CompletionLogprobs() for _ in range(k)] if want_lp else None
        if want_lp and req.echo:
            for i in range(k):
                lps[i] = builders[i].prompt(prompts[i // n].token_ids)

        def on_output(i, out):
            if want_lp:
                builders[i].add(out.new_logprobs, into=lps[i])

        try:
            finals = await self._collect(request, gen, k, on_output)
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_dead") from None
        finally:
            gen.close()
        if finals is None:  # the client left; nobody reads this
            return Response(status_code=499)
        choices = [
            CompletionChoice(
                index=i, text=(echo_text(i) if req.echo else "") + out.text,
                logprobs=lps[i] if want_lp else None,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            )
            for i, out in enumerate(finals)
        ]
        resp = CompletionResponse(id=gen.request_ids[0].rsplit("-", 1)[0], created=created, model=model,
                                  choices=choices, usage=self._usage(prompts, finals, n))
        return _json(resp)

    async def _stream_completion(self, gen, model, created, prompts, n, k, echo, echo_text,
                                 builders, include_usage) -> AsyncIterator[str]:
        rid = gen.request_ids[0].rsplit("-", 1)[0]
        finals: list[RequestOutput | None] = [None] * k

        def chunk(i, text, lp=None, out=None):
            return _sse(CompletionResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
                index=i, text=text, logprobs=lp,
                finish_reason=out.finish_reason if out is not None and out.finished else None,
                stop_reason=out.stop_reason if out is not None and out.finished else None)]))

        if echo:
            for i in range(k):
                lp = builders[i].prompt(prompts[i // n].token_ids) if builders else None
                yield chunk(i, echo_text(i), lp)
        async for i, out in gen.outputs():
            lp = builders[i].add(out.new_logprobs) if builders else None
            if out.finished:
                finals[i] = out
            elif not out.new_text and not (lp and lp.tokens):
                continue
            yield chunk(i, out.new_text, lp, out)
        if include_usage:
            yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                          usage=self._usage(prompts, finals, n)))

    # ---- /v1/chat/completions ---------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported", param="response_format")
        messages = []
        for i, m in enumerate(req.messages):
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
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return _Prompt(text, ids)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        model = self.resolve_model(req.model)
        prompt = self._chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        top_n = req.top_logprobs or 0
        params = self._sampling_params(req, max_tokens, top_n if req.logprobs else None)
        n = params.n
        gen = self._start([prompt], params, req.priority, "messages", "chatcmpl")
        created = now()
        texts = [_TokenTexts(self.tokenizer, prompt.token_ids, params.skip_special_tokens)
                 for _ in range(n)] if req.logprobs else None

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream_chat(gen, model, created, prompt, n, texts, top_n, include_usage)
            return EventStream(_guarded_sse(gen, events))

        lps: list[list[ChatTokenLogprob]] = [[] for _ in range(n)]

        def on_output(i, out):
            if texts is not None:
                lps[i].extend(_chat_logprobs(texts[i], out.new_logprobs, top_n))

        try:
            finals = await self._collect(request, gen, n, on_output)
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_dead") from None
        finally:
            gen.close()
        if finals is None:
            return Response(status_code=499)
        choices = [
            ChatChoice(index=i, message=AssistantMessage(content=out.text),
                       logprobs=ChatLogprobs(content=lps[i]) if texts is not None else None,
                       finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            for i, out in enumerate(finals)
        ]
        resp = ChatCompletionResponse(id=gen.request_ids[0].rsplit("-", 1)[0], created=created, model=model,
                                      choices=choices, usage=self._usage([prompt], finals, n))
        return _json(resp)

    async def _stream_chat(self, gen, model, created, prompt, n, texts, top_n, include_usage) -> AsyncIterator[str]:
        rid = gen.request_ids[0].rsplit("-", 1)[0]
        finals: list[RequestOutput | None] = [None] * n

        def chunk(i, delta, lp=None, out=None):
            done = out is not None and out.finished
            return _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
                index=i, delta=delta, logprobs=ChatLogprobs(content=lp) if lp is not None else None,
                finish_reason=out.finish_reason if done else None,
                stop_reason=out.stop_reason if done else None)]))

        for i in range(n):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for i, out in gen.outputs():
            lp = _chat_logprobs(texts[i], out.new_logprobs, top_n) if texts is not None else None
            if out.new_text or lp:
                yield chunk(i, DeltaMessage(content=out.new_text), lp)
            if out.finished:
                finals[i] = out
                yield chunk(i, DeltaMessage(), None, out)
        if include_usage:
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                           usage=self._usage([prompt], finals, n)))

    # ---- shutdown --------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Stop accepting; abort what is still in flight after the grace period (event loop thread)."""
        if self.draining:
            return
        self.draining = True
        self.async_engine.stop_accepting()
        in_flight = self.async_engine.num_in_flight
        grace = self.settings.shutdown_grace_s
        logger.warning("shutting down: %d requests in flight get %.1f s to finish", in_flight, grace)
        if in_flight:
            asyncio.get_running_loop().call_later(grace, self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        if self.async_engine.num_in_flight:
            logger.warning("grace period over: aborting %d requests", self.async_engine.num_in_flight)
            self.async_engine.abort_all()


def _sub_params(p: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of n: its own seed, so the choices differ but stay reproducible."""
    return replace(p, n=1, seed=None if p.seed is None else p.seed + index)
