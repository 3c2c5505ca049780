"""``travelator serve --data-parallel-size N``: N replicas, each a ``travelator serve`` with
the same arguments on a loopback port and its own cores, behind a front end on ``--host``
and ``--port``."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from travelator.replicas.cores import core_shares
from travelator.replicas.frontend import build_replica_app
from travelator.replicas.response_homes import ResponseHomes
from travelator.replicas.routing import PrefixRouter
from travelator.replicas.supervisor import ReplicaSet

# The front end's own options, not passed on to the replicas (flag -> takes a value).
_FRONT_END_FLAGS = {"--data-parallel-size": True, "--host": True, "--port": True}


def replica_serve_args(serve_argv: list[str]) -> list[str]:
    """``serve``'s arguments as given, less the front end's own."""
    kept, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _FRONT_END_FLAGS:
            skip = "=" not in arg and _FRONT_END_FLAGS[flag]
            continue
        kept.append(arg)
    return kept


def serve_replicas(args: argparse.Namespace, serve_argv: list[str]) -> int:
    if args.disaggregate is not None:
        raise ValueError("--data-parallel-size and --disaggregate cannot be combined: "
                         "each replica is one engine")
    shares = core_shares(args.data_parallel_size)
    router = PrefixRouter(len(shares))
    homes = ResponseHomes(len(shares) * args.response_store_max_count)  # as many as the replicas keep

    def on_change(replica: int, up: bool) -> None:
        router.set_alive(replica, up)
        homes.set_alive(replica, up)

    replicas = ReplicaSet(replica_serve_args(serve_argv), shares, on_change=on_change)
    app = build_replica_app(replicas, router, homes)
    print(f"serving {len(shares)} replicas on http://{args.host}:{args.port}/v1 (cores "
          f"{'; '.join(','.join(map(str, sorted(s))) for s in shares)})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.access_log, lifespan="on")
    return 0
