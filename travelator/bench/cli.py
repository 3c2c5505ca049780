"""``travelator bench throughput | serve | compare | interference | soak``.

``add_bench_parser(subparsers)`` adds the ``bench`` command to the main CLI;
``python -m travelator.bench.cli <throughput|serve|compare|soak> ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from travelator.bench.arrivals import parse_rate
from travelator.bench.compare import BATCHING_MODES, DEFAULT_MODES, jsonable
from travelator.bench.metrics import compute_metrics, format_metrics, format_table, parse_slo
from travelator.bench.soak.cli import add_soak_parser
from travelator.bench.workloads import WORKLOADS, Workload, make_workload
from travelator.default_model import resolve_model
from travelator.engine_args import add_engine_args, engine_argv, engine_kwargs

_EPILOG = """Workloads (outputs are always forced to their lengths with ignore_eos):
  orca            prompt/output lengths uniform in --prompt-len-range / --output-len-range
                  (Orca's synthetic trace: [32, 512] and [1, 128])
  conversational  heavy-tailed, ShareGPT-like log-normal lengths (see travelator/bench/workloads.py)
  fixed           every request --prompt-len prompt tokens and --output-len output tokens
"""


# ---- shared options -------------------------------------------------------------------
def _add_workload_args(p: argparse.ArgumentParser, num_requests: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="orca", choices=WORKLOADS)
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--workload-seed", type=int, default=0, help="seed of lengths and prompt ids")
    g.add_argument("--prompt-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=[32, 512],
                   help="orca: prompt lengths, uniform, inclusive (default 32 512)")
    g.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=[1, 128],
                   help="orca: output lengths, uniform, inclusive (default 1 128)")
    g.add_argument("--prompt-len", type=int, default=128, help="fixed: prompt length")
    g.add_argument("--output-len", type=int, default=128, help="fixed: output length")
    g.add_argument("--max-prompt-len", type=int, default=2048, help="conversational: clip prompts")
    g.add_argument("--max-output-len", type=int, default=2048, help="conversational: clip outputs")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, in milliseconds: ttft:500 tpot:50 e2el:10000 itl:200")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


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
        from travelator.bench.hf_baseline import run_transformers, transformers_available

        if not transformers_available():
            print("transformers is not installed: skipping --hf-baseline", file=sys.stderr)
        else:
            dtype = str(engine.dtype).replace("torch.", "")
            arch = engine.arch
            del engine  # free its memory before the peer loads
            batch = args.hf_batch_size or kw["max_num_seqs"]
            hf_run, padding = run_transformers(arch, workload, batch_size=batch, dtype=dtype,
                                               seed=args.seed, progress=progress)
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
            report["transformers"] = {"metrics": hf, "padding": padding, "ratio_output_tok_s": ratio}
            failed += hf["failed"]
    _write_json(args.output_json, report)
    return 1 if failed else 0


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


# ---- the parser -----------------------------------------------------------------------
def _add_modes_arg(p: argparse.ArgumentParser, default, default_text: str) -> None:
    """--batching as a list of modes, replacing the engine's single --batching (each engine
    of the run gets one mode; the engine setting keeps its default)."""
    p.add_argument("--batching", nargs="+", dest="batching_modes", default=list(default),
                   metavar="MODE", help="batching modes, any of static dynamic orca iteration "
                                        f"(chunked = iteration; default: {default_text})")
    p.set_defaults(batching="iteration")


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: offline throughput, online serving, static vs iteration-level, "
                      "soak",
        description="Benchmarks. Every workload is generated from a seed; outputs are forced to "
                    "their lengths so that runs are compared on the same work.")
    sub = bench.add_subparsers(dest="bench_command", required=True,
                               metavar="{throughput,serve,compare,interference,soak}")
    fmt = argparse.RawDescriptionHelpFormatter

    tp = sub.add_parser("throughput", help="offline: every request at once, through the engine",
                        epilog=_EPILOG, formatter_class=fmt)
    add_engine_args(tp)
    _add_workload_args(tp, num_requests=64)
    _add_output_args(tp)
    g = tp.add_argument_group("extras")
    g.add_argument("--hf-baseline", action="store_true",
                   help="also run the workload through transformers' generate in padded static "
                        "batches (a model of the same shape, random weights)")
    g.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-num-seqs")
    g.add_argument("--profile", action="store_true",
                   help="print where the time goes (torch.profiler top operators, engine phases)")
    g.add_argument("--profile-trace", default=None, help="with --profile: write a Chrome trace here")
    tp.set_defaults(func=cmd_throughput)

    sv = sub.add_parser("serve", help="online: streaming requests against a server URL, or one it starts",
                        epilog=_EPILOG, formatter_class=fmt)
    add_engine_args(sv)
    _add_workload_args(sv, num_requests=64)
    _add_output_args(sv)
    g = sv.add_argument_group("load")
    g.add_argument("--base-url", default=None,
                   help="e.g. http://127.0.0.1:8000; default: start `travelator serve` with the "
                        "engine options given here, on a free port, and stop it at the end")
    g.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="requests/s (one or a sweep; inf sends all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, <1 = burstier")
    g.add_argument("--arrival-seed", type=int, default=0)
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--served-model-name", default=None, help="default: the first of /v1/models")
    g.add_argument("--api-key", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="for prompt ids against an unknown server model; default: the --model's")
    g.add_argument("--no-warmup", dest="warmup", action="store_false")
    g.add_argument("--server-arg", action="append", default=None,
                   help="extra argument for the started server (repeatable)")
    g.add_argument("--server-timeout", type=float, default=180.0, help="seconds to wait for /health")
    g.add_argument("--server-log", default=None, help="write the started server's output here")
    sv.set_defaults(func=cmd_serve)

    cp = sub.add_parser("compare", help="Orca's experiment: static, dynamic, Orca and chunked batching "
                                        "over a sweep of request rates",
                        description="Runs the same workload and Poisson arrivals through engines "
                                    "that differ only in the batching, writes compare.json and two "
                                    "PNGs to --output-dir, and ends with the throughput ratio of the "
                                    "newest mode against each other at the same latency target.",
                        epilog=_EPILOG, formatter_class=fmt, conflict_handler="resolve")
    add_engine_args(cp)
    _add_modes_arg(cp, DEFAULT_MODES, "static iteration")
    _add_workload_args(cp, num_requests=32)
    g = cp.add_argument_group("sweep")
    g.add_argument("--request-rates", nargs="+", default=["0.5", "1", "2", "4"], metavar="RATE",
                   help="requests/s, Poisson arrivals (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--arrival-seed", type=int, default=0)
    g.add_argument("--latency-target", type=float, default=None,
                   help="s/token for the ratio line; default: twice the lowest median normalised "
                        "latency measured")
    g.add_argument("--occupancy-rate", type=float, default=None,
                   help="the rate whose step trace is plotted (default: the highest)")
    g.add_argument("--output-dir", default="bench-results", help="compare.json and the PNGs go here")
    g.add_argument("--no-progress", action="store_true")
    cp.set_defaults(func=cmd_compare)

    it = sub.add_parser(
        "interference", help="prefill against decode: steady decodes while long prompts arrive, "
                             "per batching mode",
        description="A few requests decode steadily while long prompts arrive; every batching mode "
                    "serves the same requests at the same times. Reports the time between tokens "
                    "of the decodes (p50, p99, longest gap), TTFT of the long prompts and "
                    "throughput; writes interference.json, tbt_cdf.png and step_timeline.png.",
        conflict_handler="resolve")
    add_engine_args(it)
    _add_modes_arg(it, BATCHING_MODES, "all four")
    g = it.add_argument_group("workload")
    g.add_argument("--num-decodes", type=int, default=8, help="steady decodes, present at the start")
    g.add_argument("--decode-prompt-len", type=int, default=32)
    g.add_argument("--decode-output-len", type=int, default=384)
    g.add_argument("--num-long", type=int, default=6, help="long prompts")
    g.add_argument("--long-prompt-len", type=int, default=1536)
    g.add_argument("--long-output-len", type=int, default=8)
    g.add_argument("--first-long-at", type=float, default=0.5, help="seconds from the start")
    g.add_argument("--long-every", type=float, default=0.5, help="seconds between long prompts")
    g = it.add_argument_group("run")
    g.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved")
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="also run the fifth mode: P prefill and D decode worker processes (chunked "
                        "prefill in each), the cores shared out between them; e.g. 1:1")
    g.add_argument("--output-dir", default="bench-results")
    g.add_argument("--no-progress", action="store_true")
    it.set_defaults(func=cmd_interference)

    add_soak_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """``python -m travelator.bench.cli throughput ...`` (the ``bench`` word is implied)."""
    parser = argparse.ArgumentParser(prog="travelator")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
