"""The engine's step loop in a background thread, with one async stream per request.

The HTTP side never waits on a step: it validates and tokenises a request on its own
thread (``LLMEngine.make_request`` changes no engine state), hands it over through a
command queue, and reads that request's outputs from an asyncio queue. The step
thread owns the engine: only it adds, aborts and steps. torch releases the GIL in its
kernels, so the event loop keeps serving while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from travelator.engine.engine import LLMEngine, StepStats
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request
from travelator.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served."""


@dataclass(slots=True)
class _Add:
    request: Request


@dataclass(slots=True)
class _Abort:
    request_id: str


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._accepting = True
        # Called on the step thread after every step (metrics); must be quick and thread-safe.
        self.step_listeners: list[Callable[[StepStats, list[RequestOutput]], None]] = []

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="travelator-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stop_accepting(self) -> None:
        self._accepting = False

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0) -> tuple[Request, asyncio.Queue]:
        """Validate (raising ValueError) and queue; returns the request and its output queue."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        req = self.engine.make_request(prompt, params, request_id, priority)
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = stream
        self._commands.put(_Add(req))
        return req, stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; abort it if the consumer goes away."""
        req, stream = self.add_request(prompt, params, request_id, priority)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, ValueError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine has stopped: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))

    # ---- the step thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    return
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if self.engine.last_step is not None:
                        for listener in self.step_listeners:
                            listener(self.engine.last_step, outputs)
        except BaseException as exc:  # the loop died: fail everyone, never hang them
            logger.exception("the step loop died")
            self.error = exc
            for rid in list(self._streams):
                self._push(rid, exc)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                if cmd.request.request_id in self._streams:  # not aborted meanwhile
                    try:
                        self.engine.enqueue(cmd.request)
                    except ValueError as exc:
                        self._push(cmd.request.request_id, exc)
            elif isinstance(cmd, _Abort):
                self._deliver(self.engine.abort_request([cmd.request_id]))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._push(out.request_id, out)

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(stream.put_nowait, item)
