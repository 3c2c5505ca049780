"""The seam between the HTTP side and "an engine": ``EngineClient``.

The server, its metrics and the live view are written against this protocol alone, never
against a concrete engine. Two classes implement it: ``AsyncEngine`` (one ``LLMEngine`` stepped
on a background thread) and ``DisaggregatedFrontEnd`` (prefill and decode worker processes).

- ``RequestSpec``: what a caller asks for, as one value (prompt, sampling parameters, id,
  priority, cache salt).
- ``make_request(spec)`` validates and tokenises, once: the ``Request`` it returns is the one
  ``submit`` queues. It changes no engine state, so any thread may call it.
- ``EngineSnapshot``: a read-only copy of what metrics and views show (queues, KV pool, prefix
  cache, counters), taken at once so its figures belong together.
- ``ServedModel``: the facts about the model that the HTTP side reads (name, tokenizer, context).

``StepStats`` and ``EngineCounters`` (what listeners and snapshots carry) are exported here
too, so that the HTTP side needs no import from a concrete engine's module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from travelator.engine.engine import EngineCounters, StepStats
from travelator.engine.request import RequestSpec

if TYPE_CHECKING:
    from travelator.engine.engine import LLMEngine
    from travelator.engine.grammar_compiler import GrammarCompiler
    from travelator.engine.outputs import RequestOutput
    from travelator.engine.request import Request
    from travelator.model.tokenizer import Tokenizer

__all__ = ["DeathListener", "EngineClient", "EngineCounters", "EngineDeadError", "EngineSnapshot",
           "LiveBatch", "RequestSpec", "ServedModel", "StepListener", "StepStats", "call_listeners",
           "read_stream", "stream_outputs"]

logger = logging.getLogger(__name__)

StepListener = Callable[[StepStats, "list[RequestOutput]"], None]
DeathListener = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine has stopped (or is shutting down); no request can be served."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the HTTP side needs of the model: no weights, only its name and its text."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    grammars: GrammarCompiler  # structured outputs compile here before a request is made
    hidden_size: int  # an embedding's length
    matryoshka_dimensions: tuple[int, ...] = ()  # the shorter lengths it may be cut to
    kv_block_size: int = 16  # tokens per KV block (what routers' load reports count in)
    max_num_seqs: int = 0  # most requests in one step (0: not known)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's figures at one moment, for metrics and views (all requests and blocks
    of every live worker, for a disaggregated engine)."""

    num_running: int
    num_waiting: int  # preempted requests and those held back included
    num_in_flight: int  # submitted and not yet seen finish
    kv_total_blocks: int
    kv_used_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int  # holding a reusable prefix, in use or free
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    counters: EngineCounters  # a copy: never updated after the snapshot is taken

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class LiveBatch:
    """One engine's running batch, for the live view. ``engine`` may be read only from the
    listeners, which run on its step thread between two steps."""

    engine: LLMEngine
    step_listeners: list[StepListener]
    idle_listeners: list[Callable[[], None]]  # once each time the engine runs out of work


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs of an engine. Every method runs on the event loop's thread,
    except where a listener says otherwise."""

    # Called after every step with its figures and outputs; must be quick and thread-safe.
    step_listeners: list[StepListener]
    # Called once when the engine dies, with the exception; must be quick.
    death_listeners: list[DeathListener]
    # Prometheus collectors of figures beyond the snapshot's (a disaggregated engine's per worker).
    metric_collectors: tuple[Any, ...]

    @property
    def served_model(self) -> ServedModel: ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine died; None while it lives."""

    @property
    def healthy(self) -> bool: ...

    @property
    def degraded(self) -> str | None:
        """What is missing while the engine still serves (None: nothing)."""

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None:
        """Serve on the running event loop."""

    def stop(self, timeout: float = 10.0) -> None: ...

    def stop_accepting(self) -> None: ...

    def step_running_for(self) -> float:
        """Seconds the step now running has run (0 between steps, or when unknown)."""

    def declare_dead(self, exc: BaseException) -> None:
        """Give up on the engine from another thread: every stream gets ``exc``."""

    def make_request(self, spec: RequestSpec) -> Request:
        """Validate and tokenise (InvalidRequestError naming the field at fault)."""

    def submit(self, request: Request) -> asyncio.Queue:
        """Queue a request from ``make_request``; its outputs (or an exception) arrive on the
        queue returned, until one is finished. EngineDeadError when nothing is served."""

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """Make, submit and yield the outputs of one request; abort it if the reader leaves."""

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    async def self_check(self, timeout: float = 30.0) -> dict:
        """The engine's own accounting, in ``engine_self_check``'s shape."""

    def live_batch(self) -> LiveBatch | None:
        """The one batch the live view shows; None where there is no single batch."""


async def stream_outputs(client: EngineClient, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
    """``EngineClient.generate`` in terms of its other methods (both engines use it)."""
    req = client.make_request(spec)
    stream = client.submit(req)
    async for item in read_stream(stream, lambda: client.abort(req.request_id)):
        yield item


async def read_stream(stream: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until it finishes; ``abort()`` if the reader leaves
    first. A ValueError in the queue is raised as it is, any other exception as EngineDeadError."""
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
            abort()


def call_listeners(listeners: list[Callable[..., None]], kind: str, *args: Any) -> None:
    """Call each listener; one that raises is logged and the others still run."""
    for listener in listeners:
        try:
            listener(*args)
        except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
            logger.exception("a %s listener failed", kind)
