"""The engine's step loop on a simulated clock.

The scheduler and the block manager are the engine's own (``make_scheduler``,
``KVCacheManager``); only the model runner is replaced: a step takes the seconds the cost
model gives for its shape, every request that reaches the end of its known tokens samples
``SAMPLED_TOKEN_ID``, and a request stops when it has its workload's output length, as
``max_tokens`` with ``ignore_eos`` stops it in the engine. Requests join when their arrival
time has passed on the simulated clock, checked between steps, as ``bench``'s runner does on
the wall clock; the result is the ``RunResult`` that runner returns, in simulated seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from travelator.bench.metrics import RequestResult
from travelator.bench.runner import RunResult, StepRecord, sampling_params_for
from travelator.bench.workloads import Workload
from travelator.config import CacheConfig, SchedulerConfig
from travelator.engine.block_manager import KVCacheManager
from travelator.engine.request import Request, RequestStatus, Stop
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_factory import make_scheduler
from travelator.engine.scheduler_output import RunnerOutput, SampledToken, SchedulerOutput
from travelator.engine.step_stats import StepStats
from travelator.sim.cost_model import CostModel, StepHistory, StepShape

# What every simulated sample is: any id that is no EOS (the workload forces lengths anyway).
SAMPLED_TOKEN_ID = 5


@dataclass(slots=True)
class SimulatedClock:
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class SimSetup:
    """The engine settings the simulation honours, and the KV pool's size in blocks."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    num_kv_blocks: int
    # Speculative decoding: the chance that each draft is accepted (the tokens' agreement is
    # not simulated, only how often it happens).
    draft_acceptance: float = 0.0
    seed: int = 0
    # What the simulated process ran before (``StepHistory``): the row counts of its steps,
    # whose first step's extra cost is not paid again (empty: a freshly started engine), the
    # rows of its last steps (the latest first) and the steps since it was idle.
    seen_rows: frozenset[int] = frozenset()
    recent_rows: tuple[int, ...] = ()
    since_idle: int = 0


class Simulation:
    def __init__(self, setup: SimSetup, cost: CostModel) -> None:
        setup.scheduler.validate()
        self.setup = setup
        self.cost = cost
        self.clock = SimulatedClock()
        self.kv = KVCacheManager(setup.num_kv_blocks, setup.cache.block_size,
                                 enable_prefix_caching=setup.cache.enable_prefix_caching)
        self.scheduler: SchedulerBase = make_scheduler(setup.scheduler, self.kv, lambda: self.clock.now)
        self._rng = np.random.default_rng(setup.seed)
        self.history = StepHistory(setup.seen_rows, setup.recent_rows, setup.since_idle)

    def run(self, workload: Workload, arrivals) -> RunResult:
        arrivals = np.asarray(arrivals, dtype=float)
        n = len(workload)
        if len(arrivals) != n or (n and np.any(np.diff(arrivals) < 0)):
            raise ValueError("one arrival time per request, sorted")
        capacity = self.setup.num_kv_blocks * self.setup.cache.block_size
        results = [RequestResult(r.prompt_len, r.output_len, float(a))
                   for r, a in zip(workload.requests, arrivals)]
        index: dict[str, int] = {}
        steps: list[StepRecord] = []
        sched, clock = self.scheduler, self.clock
        nxt = done = 0
        last_end = 0.0  # when the last step ended: a later start means the engine idled
        while done < n:
            while nxt < n and arrivals[nxt] <= clock.now:
                spec = workload.requests[nxt]
                if spec.prompt_len + spec.output_len > capacity:
                    raise ValueError(f"request {nxt} needs {spec.prompt_len + spec.output_len} tokens of KV, "
                                     f"more than the pool's {capacity}")
                req = Request(f"sim-{nxt}", list(spec.prompt_token_ids), sampling_params_for(spec.output_len),
                              max_tokens=spec.output_len)
                sched.add_request(req)
                index[req.request_id] = nxt
                nxt += 1
            next_arrival = arrivals[nxt] if nxt < n else None
            if not sched.has_unfinished():
                clock.now = float(next_arrival)
                continue
            if hold := sched.seconds_until_admission():  # dynamic batching waits for company
                clock.now = min(clock.now + hold, next_arrival if next_arrival is not None else float("inf"))
                continue
            out = sched.schedule()
            if out.is_empty:
                if next_arrival is None:
                    raise RuntimeError(f"the scheduler schedules nothing, {n - done} requests unfinished")
                clock.now = float(next_arrival)
                continue
            seconds = self.cost.step_seconds(self.history.mark(StepShape.of(out), clock.now - last_end))
            clock.now += seconds
            last_end = clock.now
            sampled = self.sample(out)
            done += self._finish_step(out, sampled, results, index)
            steps.append(StepRecord(clock.now, self.step_stats(out, sampled, seconds)))
        return RunResult(results, clock.now, steps, self.setup.scheduler.max_num_seqs)

    def _finish_step(self, out: SchedulerOutput, sampled: RunnerOutput, results: list[RequestResult],
                     index: dict[str, int]) -> int:
        """What the engine does with the step's samples: update the requests, record their
        tokens, stop those at their length. Returns how many requests finished."""
        sched, now = self.scheduler, self.clock.now
        finished = 0
        for req, toks in sched.update_from_output(out, sampled):
            r = results[index[req.request_id]]
            # Tokens past max_tokens (accepted drafts) are dropped, as find_stop drops them.
            extra = max(len(req.output_token_ids) - req.max_tokens, 0)
            r.token_times.extend([now] * (len(toks) - extra))
            if len(req.output_token_ids) >= req.max_tokens:
                sched.stop_request(req, extra, Stop(RequestStatus.FINISHED_LENGTH))
                r.end, r.output_len, r.success = now, len(req.output_token_ids), True
                finished += 1
        return finished

    def sample(self, out: SchedulerOutput) -> RunnerOutput:
        """A sample for every request whose scheduled tokens reach the end of its known ones,
        after the drafts the acceptance rate lets through (each accepted with that chance,
        the first refused one ending the run)."""
        result = RunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens + n < req.num_tokens:
                continue  # a prompt chunk short of the end
            drafts = out.drafts.get(rid)
            accepted = 0
            if drafts is not None:
                while accepted < drafts.num_tokens and self._rng.random() < self.setup.draft_acceptance:
                    accepted += 1
            ids = (drafts.token_ids[:accepted] if drafts is not None and drafts.token_ids
                   else [SAMPLED_TOKEN_ID] * accepted)
            result.sampled[rid] = [SampledToken(t) for t in [*ids, SAMPLED_TOKEN_ID]]
        return result

    def step_stats(self, out: SchedulerOutput, sampled: RunnerOutput, seconds: float) -> StepStats:
        accepted = sum(len(sampled.tokens_of(rid)) - 1 for rid in out.drafts if rid in sampled.sampled)
        return StepStats(
            num_requests=len(out.num_scheduled_tokens), num_tokens=out.total_num_scheduled_tokens,
            num_prefill_tokens=out.num_prefill_tokens, num_decodes=out.num_decodes,
            num_preempted=out.num_preempted, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_usage=self.kv.usage, duration_s=seconds,
            num_draft_tokens=out.num_draft_tokens, num_accepted_draft_tokens=accepted,
            num_speculating=len(out.drafts))
