"""``travelator simulate``: a deployment's latency and throughput from the engine's own
scheduler on a simulated clock; ``travelator fit-step-cost``: the cost model it runs on,
fitted from a short profiling run of the real engine here."""

from __future__ import annotations

import argparse
import sys

from travelator.bench.cli import add_modes_arg, add_workload_args
from travelator.bench.compare import (
    default_latency_target, plot_latency_vs_throughput, plot_occupancy, ratio_line,
    subject_mode, table,
)
from travelator.bench.metrics import format_metrics, format_table, parse_slo
from travelator.engine_args import add_engine_args
from travelator.sim.find_rate import parse_slo_targets


def add_simulate_parser(subparsers) -> None:
    sim = subparsers.add_parser(
        "simulate", help="simulate serving a workload: the engine's scheduler on a simulated clock",
        description="Runs the engine's own scheduler and block manager on a simulated clock, a step "
                    "costing what the cost model says, and prints what bench serve (one mode) or "
                    "bench compare (several) print, in simulated seconds.",
        conflict_handler="resolve")
    add_engine_args(sim)
    add_modes_arg(sim, ["iteration"], "iteration; also disaggregated: prefill and decode in two pools of "
                                      "the given devices each, chunked batching in both")
    add_workload_args(sim, num_requests=1000)
    g = sim.add_argument_group("arrivals")
    g.add_argument("--trace", default=None, metavar="CSV",
                   help="requests from a trace: arrival_s, prompt_tokens, output_tokens[, prefix_id, "
                        "prefix_tokens] (instead of --workload and --request-rate)")
    g.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="requests/s, one or a sweep (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    g.add_argument("--arrival-seed", type=int, default=0)
    g = sim.add_argument_group("cost model (one of)")
    g.add_argument("--cost-model", default=None, metavar="JSON",
                   help="a fitted step-cost model (travelator fit-step-cost)")
    g.add_argument("--hardware", default=None, metavar="NAME|JSON",
                   help="a roofline from the model's shape and this hardware description "
                        "(a100-sxm-80gb, h100-sxm-80gb, zen3-avx2-2core, or a JSON file)")
    g.add_argument("--model-shape", default=None, metavar="JSON",
                   help="--hardware: the model's shape from a file instead of --model")
    g.add_argument("--pipeline-stages", type=int, default=1,
                   help="--hardware: layers split over this many devices in sequence, a step per "
                        "stage in flight as the engine keeps them")
    g = sim.add_argument_group("simulation")
    g.add_argument("--handoff-gbps", type=float, default=None,
                   help="disaggregated: the KV hand-off link in GB/s (default: the --hardware interconnect)")
    g.add_argument("--draft-acceptance", type=float, default=0.7,
                   help="speculative decoding (--speculative-method ngram or draft): the chance that "
                        "each draft is accepted once those before it were")
    g.add_argument("--find-max-rate", action="store_true",
                   help="search the highest request rate that meets --slo (first batching mode)")
    g.add_argument("--slo", default=None, metavar="TARGETS",
                   help="for --find-max-rate, e.g. ttft_p99=2s,tpot_p99=100ms")
    g.add_argument("--max-num-seqs-choices", type=int, nargs="+", default=None, metavar="N",
                   help="--find-max-rate: search each of these batch sizes and report the best")
    g = sim.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, in milliseconds: ttft:500 tpot:50 e2el:10000 itl:200")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--output-dir", default=None,
                   help="several rates or modes: write latency_vs_throughput.png and batch_occupancy.png here")
    sim.set_defaults(func=cmd_simulate)

    fit = subparsers.add_parser(
        "fit-step-cost", help="profile the real engine's steps here and fit the simulator's cost model",
        description="Runs a short mix of prompts and decodes through the engine, fits seconds per "
                    "step to its prefill tokens, decodes and attention, reports the error on held-out "
                    "steps and writes the model as JSON for travelator simulate --cost-model.")
    add_engine_args(fit)
    fit.add_argument("--output", required=True, help="the cost model's JSON file")
    fit.add_argument("--profile-seconds", type=float, default=60.0,
                     help="about how long the profiling run takes (its plan runs once whole however long that takes)")
    fit.set_defaults(func=cmd_fit_step_cost)


def cmd_simulate(args: argparse.Namespace) -> int:
    from travelator.sim.setup import build_simulation

    sim = build_simulation(args)
    slo = parse_slo(args.goodput)
    if args.find_max_rate:
        return _find_max_rate(args, sim)
    from travelator.sim.sweep import sweep

    rows = sweep(sim.setup, sim.cost, sim.workload, sim.arrivals, sim.rates, sim.modes, slo, sim.handoff)
    for row in rows:
        rate = "trace" if row["rate"] is None else f"{row['rate']:g} req/s"
        print(format_metrics(row, f"simulated {row['scheduler']} @ {rate}"))
        print(f"steps {row['num_steps']}, mean batch {row.get('mean_batch_requests', 0):.1f} requests / "
              f"{row.get('mean_batch_tokens', 0):.0f} tokens, occupancy "
              f"{row.get('time_weighted_occupancy', 0):.0%}, preemptions {row.get('preemptions', 0)}, "
              f"peak KV use {row.get('max_kv_usage', 0):.0%}")
    if len(rows) > 1:
        print(table(rows))
    report = {"simulation": sim.describe(), "results": [_public(r) for r in rows]}
    if len(sim.modes) > 1 and sim.trace_path is None:
        target = default_latency_target(rows)
        subject = subject_mode(sim.modes)
        lines = [ratio_line(rows, target, subject, base)[0] for base in sim.modes if base != subject]
        print("\n".join(lines))
        report["ratio_lines"] = lines
        if args.output_dir:
            _plots(args.output_dir, rows, sim, target)
    _write(args.output_json, report)
    return 0


def _find_max_rate(args: argparse.Namespace, sim) -> int:
    import dataclasses

    from travelator.sim.sweep import DISAGGREGATED, search_max_rate, with_batching

    if args.slo is None:
        raise ValueError("--find-max-rate needs --slo, e.g. --slo ttft_p99=2s,tpot_p99=100ms")
    if sim.trace_path is not None:
        raise ValueError("--find-max-rate varies the request rate: give a --workload, not a --trace")
    targets = parse_slo_targets(args.slo)
    mode = sim.modes[0]
    split = mode == DISAGGREGATED
    setup = with_batching(sim.setup, "iteration" if split else mode)
    rows = []
    for seats in args.max_num_seqs_choices or [setup.scheduler.max_num_seqs]:
        if seats < 1:
            raise ValueError("--max-num-seqs-choices must be positive")
        choice = dataclasses.replace(setup, scheduler=dataclasses.replace(setup.scheduler, max_num_seqs=seats))
        search = search_max_rate(choice, sim.cost, sim.workload, sim.arrivals, targets,
                                 handoff=sim.handoff if split else None)
        rows.append({"max_num_seqs": seats, "max_rate": search.max_rate, "first_failing_rate": search.first_failing,
                     "tried": search.tried})
    if len(rows) == 1:
        print(format_table([{"rate": r, "met": "yes" if ok else "no"} for r, ok in rows[0]["tried"]],
                           [("rate (req/s)", "rate", "{:.4g}"), ("meets SLO", "met", "")]))
    else:
        print(format_table(rows, [("max_num_seqs", "max_num_seqs", "{:d}"), ("highest rate (req/s)", "max_rate", "{:.4g}"),
                                  ("first failing (req/s)", "first_failing_rate", "{:.4g}")]))
    found = [r for r in rows if r["max_rate"] is not None]
    if not found:
        print(f"no rate down to {rows[0]['tried'][-1][0]:.4g} req/s meets {args.slo}")
    else:
        best = max(found, key=lambda r: r["max_rate"])
        bound = "" if best["first_failing_rate"] is not None else " (the search's cap: no rate tried failed)"
        print(f"highest rate meeting {args.slo} ({mode} batching): {best['max_rate']:.4g} req/s with "
              f"max_num_seqs {best['max_num_seqs']}{bound}")
    _write(args.output_json, {"simulation": sim.describe(), "slo": targets, "searches": rows})
    return 0 if found else 1


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def _plots(output_dir: str, rows: list[dict], sim, target: float) -> None:
    from pathlib import Path

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"simulated: {sim.describe()['model']} on {sim.describe()['cost_model']}"
    modes = sim.modes
    print(f"wrote {plot_latency_vs_throughput(rows, modes, target, out / 'latency_vs_throughput.png', title)}",
          file=sys.stderr)
    top = max(r["rate"] for r in rows)
    traces = {r["scheduler"]: r["_steps"] for r in rows if r["rate"] == top}
    path = plot_occupancy(traces, modes, sim.setup.scheduler.max_num_seqs, top, out / "batch_occupancy.png", title)
    print(f"wrote {path}", file=sys.stderr)


def _write(path: str | None, report: dict) -> None:
    if path:
        import json
        from pathlib import Path

        from travelator.bench.compare import jsonable

        Path(path).write_text(json.dumps(jsonable(report), indent=1))
        print(f"wrote {path}", file=sys.stderr)


def cmd_fit_step_cost(args: argparse.Namespace) -> int:
    from travelator.sim.profiling import fit_from_engine

    model, report = fit_from_engine(args)
    model.save(args.output)
    print(report)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
