"""What each ``travelator bench`` command does, once its arguments are parsed: build the
workload, run it (offline through an engine, or online against a server), print the tables
and write the JSON report. The arguments themselves are defined in ``cli.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from travelator.bench.arrivals import parse_rate
from travelator.bench.compare import jsonable
from travelator.bench.metrics import compute_metrics, format_metrics, format_table, parse_slo
from travelator.bench.workloads import Workload, make_workload
from travelator.default_model import resolve_model
from travelator.engine_args import engine_argv, engine_kwargs

if TYPE_CHECKING:
    from travelator.model.arch import ModelArch


def build_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int | None) -> Workload:
    kind = args.workload
    kw: dict = {}
    if kind == "orca":
        kw = dict(prompt_len_range=tuple(args.prompt_len_range),
                  output_len_range=tuple(args.output_len_range))
    elif kind == "fixed":
        kw = dict(prompt_len=args.prompt_len, output_len=args.output_len)
    elif kind == "conversational":
        kw = dict(max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
    return make_workload(kind, args.num_requests, vocab_size=vocab_size, seed=args.workload_seed,
                         max_model_len=max_model_len, **kw)


def _rates(values: list[str]) -> list[float]:
    return [parse_rate(v) for v in values]


def _print_workload(w: Workload) -> None:
    s = w.summary()
    p, o = s["prompt_len"], s["output_len"]
    print(f"workload {s['kind']} (seed {s['seed']}): {s['num_requests']} requests, prompt "
          f"{p['min']}-{p['max']} (mean {p['mean']:.0f}), output {o['min']}-{o['max']} "
          f"(mean {o['mean']:.0f})", file=sys.stderr)


def _write_json(path: str | None, obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(jsonable(obj), indent=1))
        print(f"wrote {path}", file=sys.stderr)


def _make_engine(args: argparse.Namespace, **overrides):
    from travelator import LLM

    model = resolve_model(args)
    kw = dict(engine_kwargs(args), **overrides)
    return model, kw, LLM(model, **kw).engine


def _engine_info(engine) -> dict:
    return {"name": engine.model_name, "num_parameters": engine.arch.num_parameters,
            "dtype": str(engine.dtype).replace("torch.", ""), "device": str(engine.device),
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "scheduler": engine.config.scheduler.batching}


# ---- bench throughput -----------------------------------------------------------------
def cmd_throughput(args: argparse.Namespace) -> int:
    from travelator.bench.runner import run_engine, warm_up

    slo = parse_slo(args.goodput)
    model, kw, engine = _make_engine(args)
    workload = build_workload(args, engine.arch.vocab_size, engine.max_model_len)
    _print_workload(workload)
    warm_up(engine)
    progress = not args.no_progress
    prof = None
    if args.profile:
        from travelator.bench.profile import profile_report, torch_profiler

        with torch_profiler(args.profile_trace) as prof:
            run = run_engine(engine, workload, progress=progress, desc="throughput")
    else:
        run = run_engine(engine, workload, progress=progress, desc="throughput")
    metrics = compute_metrics(run.results, run.duration_s, slo)
    steps = run.step_summary()
    print(format_metrics(metrics, f"travelator throughput ({engine.config.scheduler.batching})"))
    print(f"steps {steps['num_steps']}, mean batch {steps.get('mean_batch_requests', 0):.1f} requests / "
          f"{steps.get('mean_batch_tokens', 0):.0f} tokens, occupancy "
          f"{steps.get('time_weighted_occupancy', 0):.0%}, preemptions {steps.get('preemptions', 0)}")
    if steps.get("draft_tokens"):
        print(f"speculative decoding: {steps['draft_tokens']} drafts proposed, {steps['accepted_draft_tokens']} "
              f"accepted (acceptance {steps['acceptance_rate']:.0%}), mean accepted length "
              f"{steps['mean_accepted_length']:.2f} per drafting request-step")
    if args.profile:
        print(profile_report(engine, run, prof))
    report = {"benchmark": "throughput", "model": model, "engine": _engine_info(engine),
              "workload": workload.summary(), "metrics": metrics, "steps": steps}
    failed = metrics["failed"]
    if args.hf_baseline:
        from travelator.bench.hf_baseline import transformers_available

        if not transformers_available():
            print("transformers is not installed: skipping --hf-baseline", file=sys.stderr)
        else:
            dtype = str(engine.dtype).replace("torch.", "")
            arch = engine.arch
            del engine  # free its memory before the peer loads
            report["transformers"] = _transformers_baseline(args, kw, arch, dtype, workload, slo, metrics)
            failed += report["transformers"]["metrics"]["failed"]
    _write_json(args.output_json, report)
    return 1 if failed else 0


def _transformers_baseline(args: argparse.Namespace, kw: dict, arch: ModelArch, dtype: str,
                           workload: Workload, slo: dict[str, float], metrics: dict) -> dict:
    """The same workload through transformers' ``generate`` in padded batches, printed beside
    travelator's ``metrics``; its part of the report."""
    from travelator.bench.hf_baseline import run_transformers

    batch = args.hf_batch_size or kw["max_num_seqs"]
    hf_run, padding = run_transformers(arch, workload, batch_size=batch, dtype=dtype,
                                       seed=args.seed, progress=not args.no_progress)
    hf = compute_metrics(hf_run.results, hf_run.duration_s, slo)
    print(format_metrics(hf, f"transformers generate (padded batches of {batch})"))
    print(f"padding: {padding['computed_tokens']} tokens computed for "
          f"{padding['useful_tokens']} useful ({padding['padding_share']:.0%} waste)")
    rows = [dict(backend="travelator", **metrics), dict(backend="transformers", **hf)]
    print(format_table(rows, [("backend", "backend", ""),
                              ("req/s", "request_throughput", "{:.3f}"),
                              ("out tok/s", "output_throughput", "{:.1f}"),
                              ("total tok/s", "total_token_throughput", "{:.1f}"),
                              ("median TTFT ms", "median_ttft_ms", "{:.0f}"),
                              ("median E2E ms", "median_e2el_ms", "{:.0f}")]))
    ratio = metrics["output_throughput"] / hf["output_throughput"]
    print(f"travelator / transformers output tokens/s: {ratio:.2f}x")
    return {"metrics": hf, "padding": padding, "ratio_output_tok_s": ratio}


# ---- bench serve ----------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from travelator.model.loader import open_model

    slo = parse_slo(args.goodput)
    rates = _rates(args.request_rate)
    model = None
    if args.vocab_size is None or args.base_url is None:
        if args.base_url is not None and args.model is None:
            print("note: prompt ids are drawn for the built-in default model's vocabulary; give "
                  "--model or --vocab-size to match the server's model", file=sys.stderr)
        model = resolve_model(args)
    if args.vocab_size is not None:
        vocab, ctx = args.vocab_size, args.max_model_len
    else:
        arch = open_model(model, "dummy").arch
        vocab, ctx = arch.vocab_size, args.max_model_len or arch.max_position_embeddings
    workload = build_workload(args, vocab, ctx)
    _print_workload(workload)
    server = None
    base_url = args.base_url
    if base_url is None:
        try:
            server = _start_server(args, model)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        base_url = server.base_url
    try:
        runs = _serve_runs(args, base_url, workload, vocab, rates, slo)
    finally:
        if server is not None:
            server.stop()
            server.close()
    if len(runs) > 1:
        rows = [dict(rate=r["rate"], **r["metrics"]) for r in runs]
        print(format_table(rows, [("rate", "rate", "{:g}"), ("req/s", "request_throughput", "{:.3f}"),
                                  ("out tok/s", "output_throughput", "{:.1f}"),
                                  ("median TTFT ms", "median_ttft_ms", "{:.0f}"),
                                  ("median TPOT ms", "median_tpot_ms", "{:.1f}"),
                                  ("p99 ITL ms", "p99_itl_ms", "{:.1f}"),
                                  ("median E2E ms", "median_e2el_ms", "{:.0f}"),
                                  ("goodput", "goodput", "{:.3f}")]))
    _write_json(args.output_json, {
        "benchmark": "serve", "base_url": base_url, "started_server": server is not None,
        "model": model, "workload": workload.summary(), "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "runs": runs})
    return 1 if any(r["metrics"]["failed"] for r in runs) else 0


def _start_server(args: argparse.Namespace, model: str):
    """``travelator serve`` with the engine options given here, on a free port; healthy."""
    from travelator.server.process import ServerProcess, free_port, serve_command

    serve_args = engine_argv(args)
    if "--model" not in serve_args:
        serve_args = ["--model", model, *serve_args]
    serve_args += args.server_arg or []
    port = free_port()
    server = ServerProcess(serve_command(serve_args, port), port, log_path=args.server_log)
    print(f"starting: {' '.join(server.argv)}", file=sys.stderr)
    try:
        server.start(args.server_timeout)
    except RuntimeError:
        server.close()
        raise
    return server


def _serve_runs(args: argparse.Namespace, base_url: str, workload: Workload, vocab: int,
                rates: list[float], slo) -> list[dict]:
    """One run of the workload per request rate (after a warm-up), each with its metrics."""
    from travelator.bench.arrivals import arrival_times
    from travelator.bench.client import ServerTarget, run_serve

    target = ServerTarget(base_url, args.served_model_name, args.api_key)
    if args.warmup:
        from travelator.bench.workloads import fixed

        warm = fixed(2, vocab_size=vocab, prompt_len=8, output_len=4)
        run_serve(target, warm, [0.0, 0.0], progress=False)
    runs = []
    for k, rate in enumerate(rates):
        arrivals = arrival_times(len(workload), rate, burstiness=args.burstiness, seed=args.arrival_seed)
        # Salted per rate so that a prefix-caching server does the same work each time.
        run = run_serve(target, workload.salted(k), arrivals, max_concurrency=args.max_concurrency,
                        progress=not args.no_progress, desc=f"serve @ {rate:g} req/s")
        m = compute_metrics(run.results, run.duration_s, slo)
        print(format_metrics(m, f"serve @ {rate:g} req/s"
                                + (f", <= {args.max_concurrency} in flight" if args.max_concurrency else "")))
        errors = sorted({r.error for r in run.results if r.error})
        for e in errors[:5]:
            print(f"  error: {e}", file=sys.stderr)
        runs.append({"rate": rate, "metrics": m, "errors": errors[:20],
                     "requests": [{"prompt_len": r.prompt_len, "output_len": r.output_len,
                                   "ttft": r.ttft, "e2e": r.e2e, "num_events": len(r.token_times)}
                                  for r in run.results]})
    return runs


# ---- bench compare --------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from travelator.bench.compare import run_compare, table
    from travelator.model.loader import open_model

    rates = _rates(args.request_rates)
    model = resolve_model(args)
    kw = engine_kwargs(args)
    arch = open_model(model, "dummy").arch
    ctx = args.max_model_len or arch.max_position_embeddings
    workload = build_workload(args, arch.vocab_size, ctx)
    _print_workload(workload)
    report = run_compare(
        model, kw, workload, rates, burstiness=args.burstiness,
        modes=args.batching_modes, arrival_seed=args.arrival_seed,
        latency_target=args.latency_target, occupancy_rate=args.occupancy_rate,
        output_dir=args.output_dir, progress=not args.no_progress,
        log=lambda s: print(s, file=sys.stderr),
    )
    print(table(report["results"]))
    for f in report["files"].values():
        print(f"wrote {f}", file=sys.stderr)
    for line in report["ratio_lines"]:
        print(line)
    return 1 if any(r["failed"] for r in report["results"]) else 0


# ---- bench interference ---------------------------------------------------------------
def cmd_interference(args: argparse.Namespace) -> int:
    from travelator.bench.interference import InterferenceSetup, run_interference, table
    from travelator.disagg.frontend import DisaggConfig

    setup = InterferenceSetup(
        num_decodes=args.num_decodes, decode_prompt_len=args.decode_prompt_len,
        decode_output_len=args.decode_output_len, num_long=args.num_long,
        long_prompt_len=args.long_prompt_len, long_output_len=args.long_output_len,
        first_long_at_s=args.first_long_at, long_every_s=args.long_every)
    report = run_interference(
        resolve_model(args), engine_kwargs(args), setup,
        modes=args.batching_modes, repeats=args.repeats, output_dir=args.output_dir, progress=not args.no_progress,
        log=lambda s: print(s, file=sys.stderr),
        disaggregate=None if args.disaggregate is None else DisaggConfig.parse(args.disaggregate))
    print(table(report["results"]))
    if args.repeats > 1:
        print(f"medians over the {args.repeats} runs of each mode:")
        print(table([dict(mode=m, **v) for m, v in report["summary"].items()], medians=True))
    for f in report["files"].values():
        print(f"wrote {f}", file=sys.stderr)
    if report["ratio_line"]:
        print(report["ratio_line"])
    return 1 if any(r["failed"] for r in report["results"]) else 0
