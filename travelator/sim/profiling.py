"""Fit the step-cost model on this machine: run a short mix of workloads through the real
engine, take every step's shape (from its ``SchedulerOutput``) and its measured duration, and
fit seconds per step by least squares; every fifth step is held out to measure the fit."""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import astuple

import numpy as np

from travelator.bench.arrivals import arrival_times
from travelator.bench.workloads import Workload, fixed, orca_synthetic
from travelator.sim.cost_model import LinearCostModel, ProfiledStep, StepShape, fit_linear, relative_errors

HELD_OUT_EVERY = 5


def profiling_plan(vocab_size: int, max_model_len: int) -> list[tuple[Workload, np.ndarray]]:
    """Decode-only batches of several sizes and context lengths, long prompts alone, and
    arrivals faster than the engine serves: a loaded run's steps, many decode rows beside a
    prompt chunk up to the token budget. Kinds take turns, so that a short budget still
    samples each of them."""
    fit = dict(vocab_size=vocab_size, max_model_len=max_model_len)

    def batch(b: int, p: int, out: int = 24) -> tuple[Workload, np.ndarray]:
        return fixed(b, prompt_len=p, output_len=out, seed=b + p, **fit), np.zeros(b)

    def loaded(n: int, rate: float, seed: int) -> tuple[Workload, np.ndarray]:
        return orca_synthetic(n, seed=seed, **fit), arrival_times(n, rate, seed=seed)

    return [batch(1, 32), loaded(16, 8.0, 13), batch(16, 64), batch(4, 1024, out=2), batch(4, 256),
            loaded(16, 16.0, 17), batch(32, 16), batch(8, 768)]


def profile_engine(engine, budget_s: float) -> list[ProfiledStep]:
    from travelator.bench.runner import run_engine, warm_up

    warm_up(engine)
    steps: list[ProfiledStep] = []

    def on_step(_outputs) -> None:
        steps.append(ProfiledStep(StepShape.of(engine.last_schedule), engine.last_step.duration_s))

    start = time.perf_counter()
    for k, (workload, arrivals) in enumerate(profiling_plan(engine.arch.vocab_size, engine.max_model_len)):
        if time.perf_counter() - start > budget_s:
            break
        # Salted per run: no prefix-cache hit on an earlier run's blocks.
        run_engine(engine, workload.salted(k + 1), arrivals, progress=False, record_steps=False, on_step=on_step)
    return steps


def fit_and_check(steps: list[ProfiledStep]) -> tuple[LinearCostModel, dict]:
    """The model fitted on four steps in five, and its error on the fifth."""
    held = steps[::HELD_OUT_EVERY]
    train = [s for i, s in enumerate(steps) if i % HELD_OUT_EVERY]
    model = fit_linear(train)
    err = relative_errors(model, held)
    pred = sum(model.step_seconds(s.shape) for s in held)
    meas = sum(s.seconds for s in held)
    check = {"profiled_steps": len(steps), "held_out_steps": len(held),
             "held_out_median_rel_error": float(np.median(err)),
             "held_out_p90_rel_error": float(np.percentile(err, 90)),
             "held_out_total_time_rel_error": (pred - meas) / meas}
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
    model, check = fit_and_check(steps)
    check["load_avg_start_end"] = load
    model.info = {"model": model_name, "engine": engine.summary, "machine": platform.processor() or platform.machine(),
                  "node": platform.node(), **check,
                  # The measurements themselves, so that a later fit can be checked against them.
                  "profile": [[*astuple(s.shape), s.seconds] for s in steps]}
    coef = ", ".join(f"{k} {v:.3g}" for k, v in model.coefficients.items())
    report = (f"fitted on {len(steps)} steps: {coef} (seconds per unit; large steps: more than "
              f"{model.large_step_rows} rows)\n"
              f"held-out steps: median error {check['held_out_median_rel_error']:.1%}, p90 "
              f"{check['held_out_p90_rel_error']:.1%}, total time {check['held_out_total_time_rel_error']:+.1%}\n"
              f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
              f"(the engine's own threads count; more means other work shared the cores)")
    return model, report
