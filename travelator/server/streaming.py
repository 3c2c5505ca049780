"""Server-sent events and client disconnects: how a response reaches the client.

A streamed response always ends with ``data: [DONE]``, after an error event if something went
wrong, and closes its generation (aborting the unfinished engine requests) however it ends. A
non-streamed response is computed under a watch for the client going away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from travelator.engine.client import EngineDeadError
from travelator.server.errors import APIError
from travelator.server.generation import Generation

logger = logging.getLogger(__name__)


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


def json_response(model) -> Response:
    # pydantic writes a non-finite float (a -inf logprob) as null, where json.dumps would fail.
    return Response(model.model_dump_json(), media_type="application/json")


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def event_stream(gen: Generation, events: AsyncIterator[str]) -> EventStream:
    """The response that relays a generation's SSE events (see ``_guarded``)."""
    return EventStream(_guarded(gen, events))


async def _guarded(gen: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
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


async def unless_disconnected(request: Request, work: Callable[[], object]):
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
            with contextlib.suppress(asyncio.CancelledError, Exception):  # nobody reads it now
                await task
