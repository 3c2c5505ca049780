"""``AsyncEngine``: one ``LLMEngine`` behind the ``EngineClient`` seam (``client.py``), its
step loop in a background thread, with one async stream per request.

The HTTP side never waits on a step: it validates and tokenises a request on its own
thread (``make_request`` changes no engine state), hands it over through a
command queue, and reads that request's outputs from an asyncio queue. The step
thread owns the engine: only it adds, aborts and steps. torch releases the GIL in its
kernels, so the event loop keeps serving while a step runs.

Watchdog: a step whose model run raises fails only that step's requests (``LLMEngine.step``
finishes them with ``finish_reason="error"``) and the loop goes on. Anything else that escapes a
step kills the loop: every waiting stream gets the exception (no client hangs), ``healthy`` turns
False, and ``death_listeners`` run (the server uses them to exit non-zero). ``step_started``
tells how long the current step has been running, so a stuck step can be noticed too.

Self-checks: ``run_on_step_thread(fn)`` runs ``fn`` on the step thread between two steps and
hands back its result, so a reader never sees half-updated engine state; ``self_check()``
uses it to report the KV pool's accounting and anything leaked (see ``self_check.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from travelator.engine.client import (
    DeathListener,
    EngineDeadError,
    EngineSnapshot,
    LiveBatch,
    RequestSpec,
    ServedModel,
    StepListener,
    call_listeners,
    stream_outputs,
)
from travelator.engine.engine import LLMEngine, StepStats
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request
from travelator.engine.self_check import engine_self_check

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request: Request


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


_STOP = object()
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._accepting = True
        arch = engine.arch
        self.served_model = ServedModel(engine.model_name, engine.tokenizer, arch.vocab_size,
                                        engine.max_model_len, engine.grammars, arch.hidden_size,
                                        arch.matryoshka_dimensions,
                                        kv_block_size=engine.config.cache.block_size,
                                        max_num_seqs=engine.config.scheduler.max_num_seqs)
        # Called on the step thread after every step (metrics); must be quick and thread-safe.
        self.step_listeners: list[StepListener] = []
        # Called on the step thread when the loop runs out of work (after its last step, or
        # after aborts that emptied it), once each time, before it waits for a command.
        self.idle_listeners: list[Callable[[], None]] = []
        # Called once on the step thread when the loop dies, with the exception; must be quick.
        self.death_listeners: list[DeathListener] = []
        # Prometheus collectors of figures beyond the engine's own (none here).
        self.metric_collectors: tuple = ()
        # time.monotonic() when the step now running began; None between steps.
        self.step_started: float | None = None
        self._death_lock = threading.Lock()

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
    def degraded(self) -> str | None:
        """What is missing while the engine still serves: never anything for one engine (a
        disaggregated server's front end can lose a worker and go on)."""
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def step_running_for(self) -> float:
        """Seconds the current step has been running (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def stop_accepting(self) -> None:
        self._accepting = False

    # ---- requests -------------------------------------------------------------------
    def make_request(self, spec: RequestSpec) -> Request:
        """Validate and tokenise (raising InvalidRequestError); changes no engine state."""
        return self.engine.make_request(spec)

    def submit(self, request: Request) -> asyncio.Queue:
        """Queue a request from ``make_request``; returns its output queue."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._commands.put(_Add(request))
        if self.error is not None:
            # The loop died between the check above and now: it may have failed the streams
            # it saw before this one was registered, and nobody would ever answer this one.
            self._streams.pop(request.request_id, None)
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        return stream

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; abort it if the consumer goes away."""
        return stream_outputs(self, spec)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))

    # ---- reading engine state ----------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Plain reads of lengths and counts, safe from any thread (the step thread may move
        them on meanwhile, as between two scrapes)."""
        e, kv = self.engine, self.engine.kv
        counters = dataclasses.replace(e.counters, finished=dict(e.counters.finished))
        return EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, num_in_flight=self.num_in_flight,
            kv_total_blocks=kv.num_blocks, kv_used_blocks=kv.num_used_blocks,
            kv_free_blocks=kv.num_free_blocks, kv_cached_blocks=kv.num_cached_blocks,
            prefix_queried_tokens=kv.stats.queried_tokens, prefix_hit_tokens=kv.stats.hit_tokens,
            counters=counters)

    def live_batch(self) -> LiveBatch:
        return LiveBatch(self.engine, self.step_listeners, self.idle_listeners)

    # ---- reading engine state safely ----------------------------------------------------
    def call_on_step_thread(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the step thread between two steps; a future of its result.

        When the loop is not running (never started, stopped or dead) nothing else touches
        the engine, so ``fn`` runs at once on the calling thread.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Call(fn, fut))
            return fut
        _run_call(fn, self.engine, fut)
        return fut

    async def run_on_step_thread(self, fn: Callable[[LLMEngine], T], timeout: float = 30.0) -> T:
        """``call_on_step_thread`` for async callers; TimeoutError if no step boundary comes in time."""
        fut = self.call_on_step_thread(fn)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), 0.25)
            except asyncio.TimeoutError:
                pass
            if fut.done():
                return fut.result()
            if self._thread is None or not self._thread.is_alive():
                # The loop ended after the command was queued and before it was read.
                if fut.set_running_or_notify_cancel():
                    _run_call(fn, self.engine, fut)
                return fut.result()
            if time.monotonic() > deadline:
                fut.cancel()
                raise TimeoutError(f"the step loop did not reach a step boundary in {timeout} s "
                                   f"(the current step has run {self.step_running_for():.1f} s)")

    async def self_check(self, timeout: float = 30.0) -> dict:
        """The engine's own accounting, read on the step thread (see ``engine_self_check``)."""
        report = await self.run_on_step_thread(engine_self_check, timeout)
        report["healthy"] = self.healthy
        report["error"] = None if self.error is None else repr(self.error)
        report["streams"] = self.num_in_flight
        report["idle"] = report["idle"] and report["streams"] == 0
        report["step_running_for_s"] = round(self.step_running_for(), 3)
        return report

    # ---- the step thread --------------------------------------------------------------
    def _run(self) -> None:
        busy = False  # held requests since the idle listeners last ran
        try:
            while True:
                # Idle: wait for a command. Holding requests back (dynamic batching): wait
                # for a command or the end of the hold, whichever comes first.
                if self.engine.has_unfinished_requests():
                    wait = self.engine.seconds_until_admission() or 0.0
                else:
                    wait = None
                    if busy:
                        busy = False
                        call_listeners(self.idle_listeners, "idle")
                if not self._drain_commands(wait):
                    return
                if self.engine.has_unfinished_requests():
                    busy = True
                    self.step_started = time.monotonic()
                    steps = self.engine.counters.steps
                    outputs = self.engine.step()
                    self.step_started = None
                    self._deliver(outputs)
                    # Not after an empty schedule (dynamic batching holding its batch):
                    # last_step is then the previous step, already reported.
                    if self.engine.counters.steps != steps and self.engine.last_step is not None:
                        self._notify_step(self.engine.last_step, outputs)
        except BaseException as exc:  # the loop died: fail everyone, never hang them
            logger.exception("the step loop died")
            self._die(exc)
        finally:
            self.step_started = None
            self._answer_leftovers()

    def declare_dead(self, exc: BaseException) -> None:
        """Give up on the step loop from another thread (a watchdog saw a step stuck): every
        waiting stream gets ``exc``, ``healthy`` turns False and the death listeners run."""
        logger.error("the step loop is declared dead: %r", exc)
        self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._death_lock:
            if self.error is not None:
                return
            self.error = exc
        for rid in list(self._streams):
            self._push(rid, exc)
        # The loop is gone already: a failing listener is logged, the others still run.
        call_listeners(self.death_listeners, "death", exc)

    def _notify_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        call_listeners(self.step_listeners, "step", stats, outputs)  # a metrics bug must not stop serving

    def _answer_leftovers(self) -> None:
        """Answer what is still queued when the loop ends: calls run (the engine is quiescent
        now), requests that never reached the engine are failed rather than left waiting."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                _run_call(cmd.fn, self.engine, cmd.future)
            elif isinstance(cmd, _Add):
                self._push(cmd.request.request_id,
                           self.error or EngineDeadError("the engine stopped before this request ran"))

    def _drain_commands(self, wait_s: float | None) -> bool:
        """Apply queued adds and aborts, waiting up to ``wait_s`` for the first (None: for
        ever); False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=wait_s != 0, timeout=wait_s or None)
            except queue.Empty:
                return True
            wait_s = 0
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
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    _run_call(cmd.fn, self.engine, cmd.future)

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
        try:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is left to read it
            pass


def _run_call(fn: Callable[[LLMEngine], Any], engine: LLMEngine, fut: concurrent.futures.Future) -> None:
    try:
        fut.set_result(fn(engine))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        fut.set_exception(exc)

