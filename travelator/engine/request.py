"""Request state as the scheduler sees it. Plain Python: no torch here."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from travelator.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, will recompute prompt + outputs
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or context length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as a caller states it; ``make_request`` turns it into a validated ``Request``.
    ``request_id`` None: the engine picks one. ``cache_salt`` keeps the request's prefix-cache
    blocks apart from requests with another salt (or none)."""

    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock moments in a request's life (time.monotonic seconds)."""

    arrival: float
    queued: float | None = None  # reached the scheduler (its clock: time.monotonic but in tests)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


def _stops_at_eos(params: SamplingParams) -> bool:
    # A constrained request ends at EOS, which its grammar allows only once complete.
    return not params.ignore_eos or params.structured is not None


def ends_with_token(params: SamplingParams, eos_token_ids: frozenset[int], token: int, num_outputs: int) -> bool:
    """Whether ``token``, as output number ``num_outputs`` (counting it), ends its request:
    EOS or a stop token, once ``min_tokens`` are out (length is checked apart)."""
    if num_outputs < params.min_tokens:
        return False
    return (_stops_at_eos(params) and token in eos_token_ids) or token in params.stop_token_ids


@dataclass(slots=True)
class SpeculationStats:
    """A request's record under speculative decoding: drafts (and free probes) proposed,
    and how many of them its own samples agreed with."""

    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1) / (self.proposed + 2)  # Laplace: 1/2 before any evidence

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Where it stands is one counter: ``num_computed_tokens`` against ``num_tokens``
    (prompt + output). A fresh prompt, a chunked prompt and a preempted request being
    recomputed are all "computed < total"; a decoding request has exactly one
    uncomputed token, the one it sampled last.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the context length
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_order: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    cache_salt: str | None = None  # keeps this request's prefix-cache entries apart
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks
    num_overtaken: int = 0  # times a later request was admitted ahead of it
    resumed_without_progress: bool = False  # preempted, readmitted, nothing computed since
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    # (logprob, top alternatives, rank) of prompt tokens 1, 2, ... as computed so far, when asked for.
    prompt_logprobs: list[tuple[float, dict[int, float], int]] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    # Speculative decoding, a step without drafts: the token the proposer expected next,
    # compared with the one sampled (a free measure of acceptance).
    speculation_probe: int | None = None
    speculation_text: str = ""  # its tokens as characters, for the n-gram lookup
    # SamplingParams.pooling: the embedding or label logprobs, once the prompt is computed.
    pooled: list[float] | None = None
    # Prefill/decode disaggregation: stop after the first token and hand the KV over to
    # another engine instead of freeing it (see kv_handoff.py).
    hand_off: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def add_prompt_logprobs(self, first: int, logprobs: list[float], tops: list[dict[int, float]],
                            ranks: list[int]) -> None:
        """Record prompt tokens ``first ..``; those already known (computed again after a
        preemption) are kept as they were."""
        known = len(self.prompt_logprobs) + 1  # the next prompt token without a logprob
        assert first <= known, "prompt logprobs arrive in order"
        skip = known - first
        self.prompt_logprobs.extend(zip(logprobs[skip:], tops[skip:], ranks[skip:]))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a request ends: its finished status, and the stop token id or stop string."""

    status: RequestStatus
    reason: int | str | None = None


def stop_by_token(req: Request, token: int, num_outputs: int) -> Stop | None:
    """Whether ``token``, as output number ``num_outputs`` (counting it), ends ``req``: EOS,
    a stop token (once ``min_tokens`` are out), or its length."""
    params = req.sampling_params
    if ends_with_token(params, req.eos_token_ids, token, num_outputs):
        if token in params.stop_token_ids and not (token in req.eos_token_ids and _stops_at_eos(params)):
            return Stop(RequestStatus.FINISHED_STOPPED, token)
        return Stop(RequestStatus.FINISHED_STOPPED)
    if num_outputs >= req.max_tokens:
        return Stop(RequestStatus.FINISHED_LENGTH)
    return None
