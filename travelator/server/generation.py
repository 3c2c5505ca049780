"""The engine requests of one HTTP request, read as one merged stream.

One HTTP request becomes ``len(prompts) * n`` engine requests: choice ``i * n + j`` is choice
``j`` of prompt ``i`` (seeded with ``seed + j``, as the offline API does). They are aborted
together when the client goes away, when the response stream is closed, or when the handler
is cancelled (``Generation.close``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from travelator.engine.client import EngineClient, EngineDeadError
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request
from travelator.server.errors import APIError


class Generation:
    def __init__(self, client: EngineClient, base_id: str, requests: list[Request]) -> None:
        """``requests``: validated by ``client.make_request``, choice k's id "<base_id>-<k>"."""
        self.client = client
        self.id = base_id  # the response's id
        self.request_ids = [r.request_id for r in requests]
        self._requests = requests
        self._queues: list[asyncio.Queue] = []
        self._getters: dict[asyncio.Future, int] = {}
        self.closed = False

    def start(self) -> None:
        try:
            for request in self._requests:
                self._queues.append(self.client.submit(request))
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
            self.client.abort(rid)


def _check(item) -> RequestOutput:
    if isinstance(item, ValueError):
        raise APIError(400, str(item))
    if isinstance(item, BaseException):
        raise EngineDeadError(f"the engine has stopped: {item!r}")
    if item.finish_reason == "error":
        raise APIError(500, f"the engine failed this request: {item.error}", code="engine_error")
    return item
