"""Drive an LLMEngine directly with a workload: all at once, or on an arrival schedule
(``run_engine``); or an engine that steps itself, through its async interface
(``run_served``: the disaggregated server's front end).

Offline runs have no HTTP in the way, so they measure the engine and its scheduler
alone. A request is added when its arrival time has passed on the wall clock (checked
between steps, as a real step loop would see it); its latency is measured from that
intended arrival time, so the time it waits for a running step to end counts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from travelator.bench.metrics import RequestResult
from travelator.bench.workloads import Workload
from travelator.engine.client import RequestSpec
from travelator.engine.engine import StepStats
from travelator.sampling_params import SamplingParams


@dataclass(slots=True)
class StepRecord:
    """One engine step: its end time (s since start) and the engine's StepStats."""

    t: float
    stats: StepStats


@dataclass(slots=True)
class RunResult:
    results: list[RequestResult]
    duration_s: float
    steps: list[StepRecord] = field(default_factory=list)
    max_num_seqs: int | None = None
    load_avg: tuple[float, float] | None = None  # 1-minute load average at start and end

    def step_summary(self) -> dict:
        """Aggregate step statistics: how full the batches were, how much was recomputed."""
        if not self.steps:
            return {"num_steps": 0}
        load = {} if self.load_avg is None else {"load_avg_start": self.load_avg[0],
                                                  "load_avg_end": self.load_avg[1]}
        reqs = np.array([s.stats.num_requests for s in self.steps], dtype=float)
        busy = np.array([s.stats.duration_s for s in self.steps])
        out = {
            "num_steps": len(self.steps),
            "mean_batch_requests": float(reqs.mean()),
            "mean_batch_tokens": float(np.mean([s.stats.num_tokens for s in self.steps])),
            "preemptions": int(sum(s.stats.num_preempted for s in self.steps)),
            "step_time_s": float(busy.sum()),
            "mean_step_ms": float(busy.mean() * 1000),
            "max_kv_usage": float(max(s.stats.kv_usage for s in self.steps)),
            **load,
        }
        drafts = sum(s.stats.num_draft_tokens for s in self.steps)
        if drafts:  # speculative decoding
            accepted = sum(s.stats.num_accepted_draft_tokens for s in self.steps)
            out.update(draft_tokens=drafts, accepted_draft_tokens=accepted, acceptance_rate=accepted / drafts,
                       mean_accepted_length=accepted / sum(s.stats.num_speculating for s in self.steps))
        if self.max_num_seqs:
            out["mean_occupancy"] = float(reqs.mean() / self.max_num_seqs)
            # Weighted by step time: the share of seat-seconds doing useful work (of the time
            # some step ran: steps in flight together fill seats together).
            wall = busy_seconds([s.t for s in self.steps], busy)
            out["time_weighted_occupancy"] = float((reqs * busy).sum() / (wall * self.max_num_seqs))
        return out

    def steps_as_lists(self) -> dict[str, list]:
        """The step trace column by column (compact for JSON)."""
        if not self.steps:
            return {}
        rows = [{"t": s.t, **asdict(s.stats)} for s in self.steps]
        return {c: [_compact(r[c]) for r in rows] for c in rows[0]}


# Less overlap than this between two steps is the rounding of a clock's sums, not steps in flight together.
_OVERLAP_NOISE_S = 1e-9


def busy_seconds(ends: Sequence[float], durations: Sequence[float]) -> float:
    """The seconds in which some step ran, each having run for its duration up to its end: their
    sum less their overlaps (several steps in flight at once, as a simulated pipeline keeps
    them; none when one step runs at a time)."""
    busy, reach = 0.0, float("-inf")
    for end, d in sorted(zip(ends, durations), key=lambda s: s[0] - s[1]):
        overlap = reach - (end - d)
        busy += d - min(overlap, d) if overlap > _OVERLAP_NOISE_S else d
        reach = max(reach, end)
    return busy


def _compact(v):
    return round(v, 5) if isinstance(v, float) else v


def sampling_params_for(output_len: int) -> SamplingParams:
    """Greedy, with the output forced to exactly ``output_len`` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(engine, num_requests: int = 2, prompt_len: int = 16, output_len: int = 4,
            on_step: Callable[[], None] | None = None) -> None:
    """Run a few short requests so one-off start-up costs stay out of the figures; ``on_step``
    hears of each step that ran (``engine.last_schedule``)."""
    vocab = engine.arch.vocab_size
    lo = 3 if vocab > 4 else 0
    rng = np.random.default_rng(12345)
    for _ in range(num_requests):
        engine.add_request(rng.integers(lo, vocab, size=prompt_len).tolist(),
                           sampling_params_for(output_len))
    while engine.has_unfinished_requests():
        engine.wait_for_admission()  # dynamic batching waits for company
        before = engine.counters.steps
        engine.step()
        if on_step is not None and engine.counters.steps != before:
            on_step()


def run_engine(engine, workload: Workload, arrivals=None, *, progress: bool = True,
               desc: str = "requests", record_steps: bool = True,
               on_step: Callable[[list], None] | None = None) -> RunResult:
    """Run ``workload`` through ``engine``; ``arrivals`` (s) default to all at time 0.
    ``on_step`` hears of each step that ran, with its outputs, right after it."""
    n = len(workload)
    arrivals = np.zeros(n) if arrivals is None else np.asarray(arrivals, dtype=float)
    if len(arrivals) != n:
        raise ValueError("one arrival time per request")
    if n and np.any(np.diff(arrivals) < 0):
        raise ValueError("arrival times must be sorted")
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests from an earlier run")
    results = [RequestResult(r.prompt_len, r.output_len, float(a))
               for r, a in zip(workload.requests, arrivals)]
    by_id: dict[str, int] = {}
    steps: list[StepRecord] = []
    bar = tqdm(total=n, desc=desc, unit="req", disable=not progress, leave=False)
    load_start = _load_1m()
    t0 = time.perf_counter()
    nxt = 0
    done = 0
    while done < n:
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            spec = workload.requests[nxt]
            try:
                req = engine.add_request(spec.prompt_token_ids, sampling_params_for(spec.output_len))
            except ValueError as e:
                results[nxt].error = str(e)
                results[nxt].end = now
                done += 1
                bar.update(1)
            else:
                by_id[req.request_id] = nxt
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt >= n:
                raise RuntimeError(f"the engine is idle but {n - done} requests never finished")
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        if engine.seconds_until_admission():  # dynamic batching waits for a fuller batch
            engine.wait_for_admission(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)) if nxt < n else None)
            continue
        before = engine.counters.steps
        outputs = engine.step()
        t = time.perf_counter() - t0
        if engine.counters.steps != before and engine.last_step is not None:
            if record_steps:
                steps.append(StepRecord(t, engine.last_step))
            if on_step is not None:
                on_step(outputs)
        for out in outputs:
            i = by_id.get(out.request_id)
            if i is None:
                continue
            _record(results[i], out, t)
            if out.finished:
                done += 1
                bar.update(1)
    duration = time.perf_counter() - t0
    bar.close()
    return RunResult(results, duration, steps, engine.config.scheduler.max_num_seqs,
                     (load_start, _load_1m()))


def _record(r: RequestResult, out, t: float) -> None:
    """One output of the request, received at ``t`` (s since the start)."""
    r.token_times.extend([t] * len(out.new_token_ids))
    if out.finished:
        r.end = t
        r.output_len = len(out.output_token_ids)
        r.success = out.finish_reason in ("length", "stop") and out.error is None
        if not r.success:
            r.error = out.error or f"finish_reason={out.finish_reason}"


def _load_1m() -> float:
    """The machine's 1-minute load average: other work competing for the cores."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_served(engine, workload: Workload, arrivals=None, *, progress: bool = True,
               desc: str = "requests") -> RunResult:
    """``run_engine`` for an ``EngineClient`` (``generate``, step listeners), which steps
    by itself: each request is added at its arrival time and its
    tokens are timed as they come out of ``generate``; steps are those the listeners hear of."""
    return asyncio.run(_run_served(engine, workload, arrivals, progress, desc))


async def _run_served(engine, workload: Workload, arrivals, progress: bool, desc: str) -> RunResult:
    n = len(workload)
    arrivals = np.zeros(n) if arrivals is None else np.asarray(arrivals, dtype=float)
    if len(arrivals) != n or (n and np.any(np.diff(arrivals) < 0)):
        raise ValueError("one arrival time per request, sorted")
    engine.start()
    results = [RequestResult(r.prompt_len, r.output_len, float(a))
               for r, a in zip(workload.requests, arrivals)]
    steps: list[StepRecord] = []
    bar = tqdm(total=n, desc=desc, unit="req", disable=not progress, leave=False)
    load_start = _load_1m()
    t0 = time.perf_counter()

    def on_step(stats: StepStats, outputs) -> None:
        steps.append(StepRecord(time.perf_counter() - t0, stats))

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
        spec, r = workload.requests[i], results[i]
        try:
            request = RequestSpec(spec.prompt_token_ids, sampling_params_for(spec.output_len))
            async for out in engine.generate(request):
                _record(r, out, time.perf_counter() - t0)
        except ValueError as e:
            r.error, r.end = str(e), time.perf_counter() - t0
        bar.update(1)

    engine.step_listeners.append(on_step)
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        engine.step_listeners.remove(on_step)
    duration = time.perf_counter() - t0
    bar.close()
    return RunResult(results, duration, steps, engine.config.scheduler.max_num_seqs, (load_start, _load_1m()))
