"""What the front end and the workers of a disaggregated server tell each other.

Commands go to one worker through its own queue (multiprocessing, FIFO); its events come
back through its own pipe. Both carry these dataclasses: pickled between processes this server
started on its own machine, and as signed msgpack (``wire.py``, ``link.py``) over one TCP
connection per worker on another host. KV data never goes through them: it moves between a
prefill and a decode worker over gloo (``kv_transport.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from travelator.engine.engine import StepStats
from travelator.engine.outputs import RequestOutput
from travelator.sampling_params import SamplingParams

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class WorkerId:
    role: str  # PREFILL or DECODE
    index: int

    def __str__(self) -> str:
        return f"{self.role} worker {self.index}"


# ---- front end -> worker --------------------------------------------------------------
@dataclass(slots=True)
class Submit:
    """To a prefill worker: compute the prompt and the first token, then send the KV to
    decode worker ``decode`` (None: the request ends at its first token)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    decode: int | None


@dataclass(slots=True)
class Expect:
    """To a decode worker: prefill worker ``prefill`` will send this request's KV."""

    request_id: str
    params: SamplingParams
    priority: int
    prefill: int


@dataclass(slots=True)
class Abort:
    """Stop the request (the client went away, or another worker failed it). A decode worker
    still expecting its KV drops the KV when it comes."""

    request_id: str


@dataclass(slots=True)
class Forget:
    """To a decode worker: no KV will come for this request (it ended at its prefill)."""

    request_id: str


@dataclass(slots=True)
class Check:
    """Report the engine's self-check (``engine_self_check``) and the worker's own maps."""

    token: int


STOP = "stop"  # the command that ends a worker


# ---- worker -> front end --------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    worker: WorkerId
    max_model_len: int
    num_blocks: int
    block_size: int
    pid: int


@dataclass(slots=True)
class WorkerStats:
    """A worker's state after a step (or at rest, now and then)."""

    free_blocks: int
    used_blocks: int
    total_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    counters: dict[str, Any]  # dataclasses.asdict(EngineCounters)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Decode: hand-offs received but not admitted yet (no room, or not expected yet).
    pending_handoffs: int = 0
    transfers: int = 0  # hand-offs sent (prefill) or received (decode)
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(slots=True)
class Report:
    """Outputs of one step, and the worker's state after it."""

    worker: WorkerId
    outputs: list[RequestOutput]
    stats: WorkerStats
    # Prefill: requests whose KV goes to a decode worker (their output is the first token,
    # not the end). Decode: requests admitted since the last report (their blocks are in
    # ``stats`` now).
    handed_off: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    # Requests this worker could not carry on (a failed transfer, a hand-off it could not
    # take): request id -> why.
    failed: dict[str, str] = field(default_factory=dict)
    # Prefill: decode workers a KV send failed to (the front end checks whether they died).
    lost_peers: list[int] = field(default_factory=list)
    step: StepStats | None = None  # the step this report follows (None: none ran)
    # The worker's time.monotonic() when it sent this: a worker on another host has its own
    # clock, so the front end moves its outputs' moments onto its own by this.
    clock: float = 0.0


@dataclass(slots=True)
class CheckReport:
    worker: WorkerId
    token: int
    report: dict[str, Any]


@dataclass(slots=True)
class Died:
    """The worker's loop stopped on an exception; the process exits after sending this."""

    worker: WorkerId
    error: str
