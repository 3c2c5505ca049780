"""``travelator bench soak``: its flags and the command."""

from __future__ import annotations

import argparse
import sys

import travelator.bench.soak as soak_package
from travelator.bench.soak.config import SoakConfig


def add_soak_parser(subparsers) -> None:
    doc = soak_package.__doc__ or ""
    p = subparsers.add_parser("soak", help="soak and chaos test of a live server (leaks, hangs)",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--url", help="drive this server instead of starting one (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model", help="model of the server started here (default: travelator's built-in)")
    p.add_argument("--requests", type=int, default=d.requests, help=f"most requests to send (default {d.requests})")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--time-limit", type=float, default=None, help="hard limit of the whole run in seconds")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate)
    p.add_argument("--burst-every", type=int, default=d.burst_every, help="0: no bursts")
    p.add_argument("--burst-size", type=int, default=None, help="default: max-waiting + max-num-seqs x engines + 8")
    p.add_argument("--invalid-rate", type=float, default=d.invalid_rate)
    p.add_argument("--long-rate", type=float, default=d.long_rate)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-require-chaos", action="store_true",
                   help="do not fail when no preemption, 503 or disconnect happened")
    g = p.add_argument_group("the server started here")
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-waiting", type=int, default=d.max_waiting)
    g.add_argument("--server-threads", type=int, default=d.server_threads, help="torch threads of the server")
    g.add_argument("--server-log", default=None)
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="start the server with P prefill and D decode workers (serve --disaggregate)")
    g.add_argument("--kill-decode-worker-after", type=int, default=None, metavar="N",
                   help="with --disaggregate: SIGKILL one decode worker once N requests are sent; its "
                        "requests must fail with a clear error, nothing else may")
    p.add_argument("--everything", action="store_true",
                   help="all at once: a batch-invariant server with priority scheduling, prefix caching and "
                        "speculative decoding (n-gram, then a draft model: two servers, half the requests "
                        "each), constrained outputs checked against their schema, regex or choices "
                        "(needs jsonschema), and every greedy answer compared with the same request alone")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_soak)


def cmd_soak(a: argparse.Namespace) -> int:
    from travelator.bench.soak.driver import run_soak

    cfg = SoakConfig(
        url=a.url, model=a.model, requests=a.requests, duration_s=a.duration, time_limit_s=a.time_limit,
        concurrency=a.concurrency, seed=a.seed, disconnect_rate=a.disconnect_rate, burst_every=a.burst_every,
        burst_size=a.burst_size, invalid_rate=a.invalid_rate, long_rate=a.long_rate,
        request_timeout_s=a.request_timeout, api_key=a.api_key,
        require_chaos=False if a.no_require_chaos else None, num_kv_blocks=a.num_kv_blocks,
        block_size=a.block_size, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_waiting=a.max_waiting, server_threads=a.server_threads, server_log=a.server_log, verbose=a.verbose,
        disaggregate=a.disaggregate, kill_decode_worker_after=a.kill_decode_worker_after,
        everything=a.everything,
    )
    result = run_soak(cfg)
    for failure in result.failures[:50]:
        print(f"soak: FAILED: {failure}", file=sys.stderr)
    if len(result.failures) > 50:
        print(f"soak: ... and {len(result.failures) - 50} more failures", file=sys.stderr)
    print(result.line(), flush=True)
    return 0 if result.ok else 1
