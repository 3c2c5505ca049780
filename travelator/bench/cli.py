"""``travelator bench throughput | serve | compare | interference | soak``: the arguments.

``add_bench_parser(subparsers)`` adds the ``bench`` command to the main CLI;
``python -m travelator.bench.cli <throughput|serve|compare|soak> ...`` runs it standalone.
What each command does is in ``commands.py``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from travelator.bench.commands import cmd_compare, cmd_interference, cmd_serve, cmd_throughput
from travelator.bench.compare import BATCHING_MODES, DEFAULT_MODES
from travelator.bench.soak.cli import add_soak_parser
from travelator.bench.workloads import WORKLOADS
from travelator.engine_args import add_engine_args

_EPILOG = """Workloads (outputs are always forced to their lengths with ignore_eos):
  orca            prompt/output lengths uniform in --prompt-len-range / --output-len-range
                  (Orca's synthetic trace: [32, 512] and [1, 128])
  conversational  heavy-tailed, ShareGPT-like log-normal lengths (see travelator/bench/workloads.py)
  fixed           every request --prompt-len prompt tokens and --output-len output tokens
"""


# ---- shared options -------------------------------------------------------------------
def add_workload_args(p: argparse.ArgumentParser, num_requests: int) -> None:
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


# ---- the parser -----------------------------------------------------------------------
def add_modes_arg(p: argparse.ArgumentParser, default, default_text: str) -> None:
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
    add_workload_args(tp, num_requests=64)
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
    add_workload_args(sv, num_requests=64)
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
    add_modes_arg(cp, DEFAULT_MODES, "static iteration")
    add_workload_args(cp, num_requests=32)
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
    add_modes_arg(it, BATCHING_MODES, "all four")
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
