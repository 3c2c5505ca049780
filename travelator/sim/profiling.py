"""Fit the step-cost model on this machine: run a short mix of workloads through the real
engine, take every step's shape (from its ``SchedulerOutput``) and its measured duration, and
fit seconds per step by least squares; every fifth step is held out to measure the fit."""

from __future__ import annotations

import argparse
import os
import platform
import re
import time

import numpy as np

from travelator.bench.arrivals import arrival_times
from travelator.bench.workloads import Workload, fixed, orca_synthetic
from travelator.model.linear_route import STREAMED_BF16_ROWS, STREAMED_QUANTIZED_ROWS
from travelator.sim.cost_model import (
    LinearCostModel, ProfiledStep, StepHistory, StepShape, fit_linear, relative_errors,
)

HELD_OUT_EVERY = 5
PLAN_PASSES = 3
# How long the engine idles before some of the plan's prompts (a light load's gaps).
IDLE_SPELL_S = 0.25
_SWITCH_PATTERNS = [re.compile(re.escape(words).replace(re.escape("{rows}"), r"(\d+)"))
                    for words in (STREAMED_BF16_ROWS, STREAMED_QUANTIZED_ROWS)]


def route_switch_rows(summary: str) -> tuple[int, ...]:
    """The row counts at which the engine's steps change kernels, as its start-up line names
    them (``engine.summary``): up to them a step streams its weights (and, where every layer
    streams, runs its layers in one native call); past them it takes the GEMM (quantized
    layers' kept copies, which may run in the native call too). Empty where it names none (no
    native kernels, a GPU, every bf16 layer on blocked_linear): the fit then tries its own
    candidates."""
    return tuple(sorted({int(m.group(1)) for p in _SWITCH_PATTERNS for m in p.finditer(summary)}))


def profiling_plan(vocab_size: int, max_model_len: int) -> list[tuple[Workload, np.ndarray]]:
    """Decode-only batches of several sizes and context lengths, long prompts alone, and
    arrivals faster than the engine serves: a loaded run's steps, many decode rows beside a
    prompt chunk up to the token budget. Single prompts of one length twice, each then decoding
    alone, the second after an idle spell: a light load's steps, the first and a later step of
    one row count, decodes streamed right after a prompt, steps after idle time
    (``StepHistory``) and one-row decodes over long contexts. Kinds take turns, so that a short
    budget still samples each of them."""
    fit = dict(vocab_size=vocab_size, max_model_len=max_model_len)

    def batch(b: int, p: int, out: int = 24) -> tuple[Workload, np.ndarray]:
        return fixed(b, prompt_len=p, output_len=out, seed=b + p, **fit), np.zeros(b)

    def loaded(n: int, rate: float, seed: int) -> tuple[Workload, np.ndarray]:
        return orca_synthetic(n, seed=seed, **fit), arrival_times(n, rate, seed=seed)

    def twice(p: int) -> list[tuple[Workload, np.ndarray]]:
        workload, _ = batch(1, p, out=16)
        return [(workload, np.zeros(1)), (workload, np.full(1, IDLE_SPELL_S))]

    return [batch(1, 32), *twice(384), loaded(16, 8.0, 13), *twice(96), batch(16, 64), *twice(640),
            batch(4, 1024, out=2), *twice(200), batch(4, 256), loaded(16, 16.0, 17), *twice(512), batch(32, 16),
            *twice(48), batch(8, 768)]


class LoopTimer:
    """Each step as the serving loop lives it (an ``on_step`` for ``bench.runner.run_engine``):
    its shape, marked with what the process ran before it (``history``), and its seconds from
    the end of the step before, where the engine had work all along in between: the step and
    the loop's own work around it (adding arrivals, handing out tokens), which the tokens'
    times count too. After the engine was idle or held its queue, the step's own duration
    plus the median of that loop work over the busy steps."""

    def __init__(self, engine, history: StepHistory) -> None:
        self.engine, self.history = engine, history
        self._timed: list[tuple[StepShape, float, float | None]] = []  # shape, duration, interval
        self._busy_since: float | None = None
        self._last_end = time.perf_counter()  # a gap from here to a step's start: idle time

    def __call__(self, _outputs=None) -> None:
        now, e = time.perf_counter(), self.engine
        duration = e.last_step.duration_s
        interval = None if self._busy_since is None else now - self._busy_since
        shape = self.history.mark(StepShape.of(e.last_schedule), idle_s=now - duration - self._last_end)
        self._timed.append((shape, duration, interval))
        self._busy_since = now if e.has_unfinished_requests() and not e.seconds_until_admission() else None
        self._last_end = now

    def steps(self) -> list[ProfiledStep]:
        loop = [i - d for _, d, i in self._timed if i is not None]
        overhead = max(float(np.median(loop)), 0.0) if loop else 0.0
        return [ProfiledStep(shape, d + overhead if i is None else i) for shape, d, i in self._timed]


def profile_engine(engine, budget_s: float, history: StepHistory | None = None,
                   passes: int = PLAN_PASSES) -> list[ProfiledStep]:
    """The steps of the profiling plan (``LoopTimer``): once whole, the shapes the fit needs,
    however long that takes on a busy machine; then up to ``passes - 1`` times more while the
    budget lasts (more steps of the same shapes, not their first); ``history``:
    what this process has run (a new one where None), which learns the plan's steps."""
    from travelator.bench.runner import run_engine, warm_up

    history = StepHistory() if history is None else history
    warm_up(engine, on_step=lambda: history.mark(StepShape.of(engine.last_schedule)))
    timer = LoopTimer(engine, history)
    plan = profiling_plan(engine.arch.vocab_size, engine.max_model_len)
    start = time.perf_counter()
    for k in range(passes * len(plan)):
        if k >= len(plan) and time.perf_counter() - start > budget_s:
            break
        workload, arrivals = plan[k % len(plan)]
        # Salted per run: no prefix-cache hit on an earlier run's blocks.
        run_engine(engine, workload.salted(k + 1), arrivals, progress=False, record_steps=False, on_step=timer)
    return timer.steps()


def fit_and_check(steps: list[ProfiledStep], switch_rows: tuple[int, ...] = ()) -> tuple[LinearCostModel, dict]:
    """The model fitted on four steps in five, and its error on the fifth; ``switch_rows``:
    where the engine's kernels change (``route_switch_rows``)."""
    held = steps[::HELD_OUT_EVERY]
    train = [s for i, s in enumerate(steps) if i % HELD_OUT_EVERY]
    model = fit_linear(train, switch_rows)
    err = relative_errors(model, held)
    pred = sum(model.step_seconds(s.shape) for s in held)
    meas = sum(s.seconds for s in held)
    check = {"profiled_steps": len(steps), "held_out_steps": len(held),
             "held_out_median_rel_error": float(np.median(err)),
             "held_out_p90_rel_error": float(np.percentile(err, 90)),
             "held_out_total_time_rel_error": (pred - meas) / meas,
             "switch_rows_named_by_engine": list(switch_rows), **model.info}
    return model, check


def fit_from_engine(args: argparse.Namespace) -> tuple[LinearCostModel, str]:
    from travelator import LLM
    from travelator.default_model import resolve_model
    from travelator.engine_args import engine_kwargs

    model_name = resolve_model(args)
    engine = LLM(model_name, **engine_kwargs(args)).engine
    # Other work on the machine stretches steps at random: the fit is only as good as the quiet.
    load = [os.getloadavg()[0]]
    steps = profile_engine(engine, args.profile_seconds)
    load.append(os.getloadavg()[0])
    model, check = fit_and_check(steps, route_switch_rows(engine.summary))
    check["load_avg_start_end"] = load
    model.info = {"model": model_name, "engine": engine.summary, "machine": platform.processor() or platform.machine(),
                  "node": platform.node(), **check,
                  # The measurements themselves, so that a later fit can be checked against them.
                  "profile": [s.to_row() for s in steps]}
    coef = ", ".join(f"{k} {v:.3g}" for k, v in model.coefficients.items())
    report = (f"fitted on {len(steps)} steps ({check['disturbed_steps_dropped']} held up by other work "
              f"dropped): {coef} (seconds per unit; large steps: more than {model.large_step_rows} rows; "
              f"the extra cost after a large step or idle time fades over {model.recovery_steps} steps)\n"
              f"held-out steps: median error {check['held_out_median_rel_error']:.1%}, p90 "
              f"{check['held_out_p90_rel_error']:.1%}, total time {check['held_out_total_time_rel_error']:+.1%}\n"
              f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
              f"(the engine's own threads count; more means other work shared the cores)")
    return model, report
