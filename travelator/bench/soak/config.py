"""What a soak run is given (``SoakConfig``) and what it found (``SoakResult``)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from travelator.bench.soak.checks import Answer
    from travelator.bench.soak.workload import Spec


@dataclass
class SoakConfig:
    url: str | None = None  # None: start a server here
    model: str | None = None  # for the server started here (default: travelator's built-in)
    requests: int = 300  # most requests sent (bursts and invalid ones included)
    duration_s: float | None = None  # stop sending after this long
    time_limit_s: float | None = None  # hard limit of the whole run (default from the above)
    concurrency: int = 8  # regular clients at once (bursts come on top)
    seed: int = 0
    disconnect_rate: float = 0.3  # share of clients that try to leave (some finish first)
    burst_every: int = 100  # regular requests between two bursts (0: no bursts)
    burst_size: int | None = None  # default: max_waiting + max_num_seqs + 8 (more than fit)
    invalid_rate: float = 0.03
    long_rate: float = 0.2
    request_timeout_s: float = 120.0  # a request not answered in this long counts as hung
    quiesce_timeout_s: float = 30.0
    api_key: str | None = None
    require_chaos: bool | None = None  # demand preemptions, 503s and disconnects (default: own server)
    # Everything at once: constrained outputs, priorities, shared prefixes and speculation on a
    # batch-invariant server, and every greedy answer compared with the same request alone.
    everything: bool = False
    # The server started here.
    num_kv_blocks: int = 24
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_waiting: int = 32
    server_threads: int = 1
    disaggregate: str | None = None  # "P:D": prefill and decode workers (serve --disaggregate)
    kill_decode_worker_after: int | None = None  # requests sent before one decode worker is killed
    speculative_method: str | None = None  # "ngram" or "draft" (the draft model: the model itself)
    server_log: str | None = None  # where its log goes (default: a temporary file)
    verbose: bool = False

    @property
    def effective_burst_size(self) -> int:
        """Default: more than the server holds (its waiting queue and every engine's seats)."""
        if self.burst_size is not None:
            return self.burst_size
        engines = sum(int(n) for n in self.disaggregate.split(":")) if self.disaggregate else 1
        return self.max_waiting + engines * self.max_num_seqs + 8


@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected_503: int = 0
    invalid_4xx: int = 0
    server_errors_5xx: int = 0
    preemptions: int | None = None
    leaked_blocks: int | None = None
    latencies: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    self_checks: int = 0  # self-checks passed while the load ran
    killed_worker: str | None = None  # "decode worker N", once the soak has killed it
    killed: int = 0  # requests that failed because they were on the killed worker
    killed_choices: int = 0  # their engine requests (n choices, prompt batches)
    failures: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    # --everything
    phases: list[str] = field(default_factory=list)  # the speculative method of each server in turn
    skipped: list[str] = field(default_factory=list)  # features the server does not support
    constrained_checked: int = 0  # constrained choices that finished ("stop") and were checked
    constrained_valid: int = 0
    constrained_cut: int = 0  # constrained choices ended by max_tokens ("length"): not checkable
    greedy_compared: int = 0
    greedy_equal: int = 0
    greedy_pending: list[tuple[Spec, Answer]] = field(default_factory=list)  # to compare alone
    priorities: Counter = field(default_factory=Counter)
    prefix_hit_tokens: int | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def p(self, q: float) -> float | None:
        if not self.latencies:
            return None
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    def line(self) -> str:
        def fmt(x, digits=3):
            return "n/a" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))
        return (f"soak: sent={self.sent} completed={self.completed} disconnected={self.disconnected} "
                f"rejected_503={self.rejected_503} invalid_4xx={self.invalid_4xx} "
                f"preemptions={fmt(self.preemptions)} leaked_blocks={fmt(self.leaked_blocks)} "
                f"5xx={self.server_errors_5xx} p50_latency_s={fmt(self.p(0.5))} "
                f"p99_latency_s={fmt(self.p(0.99))} "
                + (f"killed_worker=\"{self.killed_worker}\" failed_with_it={self.killed} " if self.killed_worker else "")
                + (self._everything_part() if self.phases else "")
                + f"self_checks={self.self_checks} duration_s={self.duration_s:.1f} "
                f"result={'PASS' if self.ok else f'FAIL({len(self.failures)})'}")

    def _everything_part(self) -> str:
        prios = f"{min(self.priorities)}..{max(self.priorities)}" if self.priorities else "n/a"
        spec = ("n/a" if self.draft_tokens is None
                else f"{self.accepted_draft_tokens}/{self.draft_tokens}")
        return (f"phases={','.join(self.phases)} "
                + (f"skipped={','.join(self.skipped)} " if self.skipped else "")
                + f"constrained_valid={self.constrained_valid}/{self.constrained_checked} "
                f"constrained_cut_by_length={self.constrained_cut} "
                f"greedy_equal_alone={self.greedy_equal}/{self.greedy_compared} "
                f"priorities={prios} prefix_hit_tokens={'n/a' if self.prefix_hit_tokens is None else self.prefix_hit_tokens} "
                f"spec_accepted={spec} ")
