"""The simulator's predictions against real runs of the same workload on this machine.

For each model: fit the step cost from a short profiling run of the engine (as
``travelator fit-step-cost`` does), then for each batching mode and request rate run the
workload through the real engine (offline, on its Poisson arrival schedule, as
``bench compare`` does) and through the simulator with the same settings and KV pool, and
report the relative error of the prediction: throughput and TTFT / TPOT p50 and p99.
The goal is within 10% at p50 and 20% at p99. Timings on a shared machine drift with its
load: the 1-minute load average is printed beside each real run. Two lines under each run
tell the drift from the simulator's own error: the profile's cost model on the run's own
steps (its total time off: the machine ran faster or slower than during the profile), and
the simulation again with the cost refitted on those steps.

    python benchmarks/sim_validate.py                       # the full table (tens of minutes)
    python benchmarks/sim_validate.py --models dummy:llama-50m --rates 1 --num-requests 16 \\
        --profile-seconds 20                                # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from travelator import LLM
from travelator.bench.arrivals import arrival_times
from travelator.bench.metrics import compute_metrics, format_markdown_table
from travelator.bench.runner import run_engine
from travelator.bench.workloads import orca_synthetic
from travelator.config import CacheConfig
from travelator.sim.cost_model import FEATURES, LinearCostModel, ProfiledStep, StepHistory, fit_linear, relative_errors
from travelator.sim.profiling import LoopTimer, fit_and_check, profile_engine, route_switch_rows
from travelator.sim.simulator import SimSetup, Simulation

COMPARED = [("req/s", "request_throughput"), ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
            ("TPOT p50", "median_tpot_ms"), ("TPOT p99", "p99_tpot_ms")]


def validate_model(model: str, args: argparse.Namespace) -> list[dict]:
    settings = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
    profiler = LLM(model, **settings).engine
    # What this process has run: the GEMM library's kernels for those row counts are made
    # already, for the profiler's engine and every later one (StepHistory).
    history = StepHistory()
    steps = profile_engine(profiler, args.profile_seconds, history)
    switch = route_switch_rows(profiler.summary)
    cost, check = fit_and_check(steps, switch)
    coef = ", ".join(f"{k} {v:.3g}" for k, v in cost.coefficients.items())
    print(f"{model}: fitted on {len(steps)} steps, {check['disturbed_steps_dropped']} held up by other work "
          f"dropped ({coef}; large steps: more than {cost.large_step_rows} rows, as the engine names its "
          f"kernel switch: {check['switch_rows_named_by_engine']}; recovery over {cost.recovery_steps} steps), "
          f"held-out median error "
          f"{check['held_out_median_rel_error']:.1%}")
    recorded = {"profile": steps}
    vocab, ctx = profiler.arch.vocab_size, profiler.max_model_len
    del profiler
    workload = orca_synthetic(args.num_requests, vocab_size=vocab, seed=args.seed,
                              prompt_len_range=tuple(args.prompt_len_range),
                              output_len_range=tuple(args.output_len_range), max_model_len=ctx)
    rows = []
    for mode in args.modes:
        engine = LLM(model, batching=mode, **settings).engine
        cache = CacheConfig(num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
        for k, rate in enumerate(args.rates):
            # The simulated process has run what this one has: the same first steps cost extra.
            setup = SimSetup(engine.config.scheduler, cache, args.num_kv_blocks, seen_rows=frozenset(history.seen),
                             recent_rows=history.recent_rows, since_idle=history.since_idle)
            arrivals = arrival_times(len(workload), rate, seed=args.seed)
            work = workload.salted(k + 1)
            load = os.getloadavg()[0]
            timer = LoopTimer(engine, history)
            real = run_engine(engine, work, arrivals, progress=False, record_steps=False, on_step=timer)
            steps = timer.steps()
            step_errors = print_step_error(mode, rate, cost, steps)
            recorded[f"{mode} {rate:g} req/s"] = steps
            sim = Simulation(setup, cost).run(work, arrivals)
            real_metrics = compute_metrics(real.results, real.duration_s)
            rows.append(compare_row(model, mode, rate, load, real_metrics, compute_metrics(sim.results, sim.duration_s)))
            rows[-1]["cost model on real steps"] = step_errors
            rows[-1]["refit on own steps"] = own_steps_errors(setup, steps, switch, work, arrivals, real_metrics)
            print(format_markdown_table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    if args.steps_json:
        # Every step's shape and time, profile and real runs: cost models can be refitted and
        # checked against the real runs offline.
        with open(f"{args.steps_json}.{model.replace(':', '_')}.json", "w") as f:
            json.dump({k: [s.to_row() for s in v] for k, v in recorded.items()}, f)
    return rows


def print_step_error(mode: str, rate: float, cost: LinearCostModel, steps: list[ProfiledStep]) -> dict:
    """The cost model against the real run's own steps: a model fitted on the profile's shapes
    is checked on the shapes a loaded run makes (mixed steps apart, where fits went wrong)."""
    mixed = [s for s in steps if s.shape.prefill_tokens and s.shape.decode_tokens]
    parts, errors = [], {}
    for label, part in (("all", steps), ("mixed", mixed)):
        if part:
            median = float(np.median(relative_errors(cost, part)))
            total = sum(cost.step_seconds(s.shape) for s in part) / sum(s.seconds for s in part) - 1
            errors[f"{label} steps"] = {"count": len(part), "median_rel_error": median, "total_time_rel_error": total}
            parts.append(f"{label} {len(part)} steps: median error {median:.1%}, total time {total:+.1%}")
    print(f"  cost model on the real {mode} run's steps at {rate:g} req/s: " + "; ".join(parts), flush=True)
    return errors


def own_steps_errors(setup: SimSetup, steps: list[ProfiledStep], switch: tuple[int, ...], work, arrivals,
                     real: dict) -> dict:
    """The simulation again, its cost refitted on the real run's own steps: what is left of the
    error is the simulator's (the scheduler, the loop, the cost model's form), not the drift
    of the machine's speed between the profile and the run."""
    if len(steps) < 2 * len(FEATURES):
        return {}
    sim = Simulation(setup, fit_linear(steps, switch)).run(work, arrivals)
    row = compare_row("", "", 0, 0, real, compute_metrics(sim.results, sim.duration_s))
    errors = {label: row[f"err {label}"] for label, _ in COMPARED}
    print("  simulated with the cost refitted on the run's own steps: "
          + ", ".join(f"{k} {v:+.0%}" for k, v in errors.items() if v is not None), flush=True)
    return errors


def compare_row(model: str, mode: str, rate: float, load: float, real: dict, sim: dict) -> dict:
    row = {"model": model, "mode": mode, "rate": rate, "load": load}
    for label, key in COMPARED:
        r, s = real.get(key), sim.get(key)
        row[f"real {label}"], row[f"sim {label}"] = r, s
        row[f"err {label}"] = None if not r or s is None else (s - r) / r
    return row


COLUMNS = [("model", "model", ""), ("mode", "mode", ""), ("rate", "rate", "{:g}"), ("load", "load", "{:.1f}")]
for _label, _ in COMPARED:
    COLUMNS += [(f"real {_label}", f"real {_label}", "{:.3g}"), (f"sim {_label}", f"sim {_label}", "{:.3g}"),
                (f"err {_label}", f"err {_label}", "{:+.0%}")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["dummy:llama-50m", "dummy:llama-250m"])
    p.add_argument("--modes", nargs="+", default=["static", "iteration"])
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len-range", type=int, nargs=2, default=[32, 512])
    p.add_argument("--output-len-range", type=int, nargs=2, default=[1, 128])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--profile-seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--steps-json", default=None, metavar="PREFIX",
                   help="write every profiled and real step to PREFIX.<model>.json")
    args = p.parse_args()
    rows = [row for model in args.models for row in validate_model(model, args)]
    print(format_markdown_table(rows, COLUMNS))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
