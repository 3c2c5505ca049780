"""The engine's step loop on a simulated clock.

The scheduler and the block manager are the engine's own (``make_scheduler``,
``KVCacheManager``); only the model runner is replaced: a step takes the seconds the cost
model gives for its shape, every request that reaches the end of its known tokens samples
``SAMPLED_TOKEN_ID``, and a request stops when it has its workload's output length, as
``max_tokens`` with ``ignore_eos`` stops it in the engine. Requests join when their arrival
time has passed on the simulated clock, checked between steps, as ``bench``'s runner does on
the wall clock; the result is the ``RunResult`` that runner returns, in simulated seconds.
With pipeline stages (a cost model that times each, ``PipelinedCostModel``) the engine keeps a
step per stage in flight, each over its share of the requests (``Simulation``).
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
from travelator.sim.cost_model import CostModel, StageTimes, StepHistory, StepShape, pipeline_stages
from travelator.sim.pipeline import Flight, Pipeline

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
    """The engine's step loop on the simulated clock. With a cost model of several pipeline
    stages it keeps a step per stage in flight as ``LLMEngine`` does (``_pipelined_step``):
    the scheduler splits the requests into micro-batches (``set_micro_batches``), a step's
    requests sit out the schedules until its tokens land (``start_flight``), and the engine
    sends steps into stage 0 while fewer than the stages are in flight and the scheduler gives
    one, else waits for the oldest step's tokens."""

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
        self.pipeline = Pipeline(pipeline_stages(cost))
        self.scheduler.set_micro_batches(self.pipeline.stages)  # as LLMEngine.set_steps_in_flight
        # When the engine moves next (``act``): stage 0 done with the step it sent, or the
        # oldest step's tokens back; None: nothing in flight and nothing it could send.
        self.due: float | None = None
        self._landing = False  # waiting for the oldest step's tokens
        self._last_end = 0.0  # when the last step landed: a later start means the engine idled

    def run(self, workload: Workload, arrivals) -> RunResult:
        arrivals = np.asarray(arrivals, dtype=float)
        n = len(workload)
        if len(arrivals) != n or (n and np.any(np.diff(arrivals) < 0)):
            raise ValueError("one arrival time per request, sorted")
        results = [RequestResult(r.prompt_len, r.output_len, float(a))
                   for r, a in zip(workload.requests, arrivals)]
        steps: list[StepRecord] = []
        clock = self.clock
        nxt = done = 0
        while done < n:
            nxt = self._admit(workload, arrivals, nxt)
            if self.due is not None and self.due > clock.now:  # stage 0 busy, or tokens on their way
                clock.now = self.due
                continue
            flight = self.act()
            if flight is not None:
                done += self._finish_step(flight, results, steps)
            elif self.due is None:
                clock.now = self._idle_until(arrivals[nxt] if nxt < n else None, n - done)
        return RunResult(results, clock.now, steps, self.setup.scheduler.max_num_seqs)

    def _admit(self, workload: Workload, arrivals: np.ndarray, nxt: int) -> int:
        """Add the requests that have arrived by now, from the ``nxt``-th; returns the first not."""
        capacity = self.setup.num_kv_blocks * self.setup.cache.block_size
        while nxt < len(arrivals) and arrivals[nxt] <= self.clock.now:
            spec = workload.requests[nxt]
            if spec.prompt_len + spec.output_len > capacity:
                raise ValueError(f"request {nxt} needs {spec.prompt_len + spec.output_len} tokens of KV, "
                                 f"more than the pool's {capacity}")
            self.scheduler.add_request(Request(f"sim-{nxt}", list(spec.prompt_token_ids),
                                               sampling_params_for(spec.output_len), max_tokens=spec.output_len))
            nxt += 1
        return nxt

    def _idle_until(self, next_arrival: float | None, unfinished: int) -> float:
        """Nothing runs: the engine waits for the next arrival, or while dynamic batching
        holds its queue for company."""
        sched = self.scheduler
        if sched.has_unfinished() and (hold := sched.seconds_until_admission()):
            return min(self.clock.now + hold, next_arrival if next_arrival is not None else float("inf"))
        if next_arrival is None:
            raise RuntimeError(f"the scheduler schedules nothing, {unfinished} requests unfinished")
        return float(next_arrival)

    def act(self) -> Flight | None:
        """The engine's next move at ``clock.now`` (``due``, or any time while idle): land the
        step it waits for (returned, for its tokens to be recorded); else send one more step
        into stage 0 while fewer than the stages are in flight and the scheduler gives one (the
        engine runs stage 0 itself, so it is busy until stage 0 is done); else wait for the
        oldest step's tokens, not scheduling again before they are back."""
        pipe = self.pipeline
        if self._landing:
            self._landing = False
            flight = pipe.land()
            self._last_end = flight.end
            return flight
        if len(pipe.flights) < pipe.stages and self._launch():
            self.due = pipe.free_at[0]
        elif pipe.flights:
            self._landing, self.due = True, pipe.flights[0].end
        else:
            self.due = None
        return None

    def _launch(self) -> bool:
        """Schedule a step now and send it into the pipeline; False when there is none to send
        (nothing unfinished, dynamic batching holding its queue, or nothing schedulable)."""
        sched, pipe, now = self.scheduler, self.pipeline, self.clock.now
        if not sched.has_unfinished() or sched.seconds_until_admission():
            return False
        out = sched.schedule()
        if out.is_empty:
            if pipe.flights:  # as the engine does: the freed ids go with the next step
                sched.return_freed(out.freed_request_ids)
            return False
        if pipe.stages > 1:
            sched.start_flight(out)
        shape = self.history.mark(StepShape.of(out), 0.0 if pipe.flights else now - self._last_end)
        times = (StageTimes((self.cost.step_seconds(shape),)) if pipe.stages == 1
                 else self.cost.stage_times(shape))
        pipe.send(out, self.sample(out), times, now)
        return True

    def _finish_step(self, flight: Flight, results: list[RequestResult], steps: list[StepRecord]) -> int:
        """What the engine does with a step's samples when they land: update the requests,
        record their tokens, stop those at their length. Returns how many requests finished."""
        sched, now = self.scheduler, flight.end
        finished = 0
        for req, toks in sched.update_from_output(flight.out, flight.sampled):
            r = results[int(req.request_id.removeprefix("sim-"))]
            # Tokens past max_tokens (accepted drafts) are dropped, as find_stop drops them.
            extra = max(len(req.output_token_ids) - req.max_tokens, 0)
            r.token_times.extend([now] * (len(toks) - extra))
            if len(req.output_token_ids) >= req.max_tokens:
                sched.stop_request(req, extra, Stop(RequestStatus.FINISHED_LENGTH))
                r.end, r.output_len, r.success = now, len(req.output_token_ids), True
                finished += 1
        steps.append(StepRecord(now, self.step_stats(flight.out, flight.sampled, flight.seconds)))
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
