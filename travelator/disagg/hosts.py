"""Disaggregated workers on several hosts, launched by torchrun.

Every host runs the same ``serve --disaggregate P:D`` command under ``torchrun --nnodes N``
(one process per node). The workers, prefill ones first and then decode ones, are dealt out
over the ranks in order (``worker_ranks``). Rank 0 is the front end, the only HTTP server: it
starts the workers of its own rank as on one machine, listens for the others on the interface
of MASTER_ADDR, publishes that address in torchrun's rendezvous store, and waits for them
(``remote.accept_workers``). Every other rank starts its workers, a process each, which
connect to the front end, prove the shared secret (``TRAVELATOR_TP_SECRET``), receive their
spec and then serve as a local worker does, their commands and reports on that connection
(``link.py``, ``wire.py``); the rank exits when they have. The KV goes from prefill to
decode worker over gloo, bound to the address each worker reaches the front end from, through
a store the front end hosts on MASTER_ADDR.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
from typing import TYPE_CHECKING

from travelator.disagg import messages as m
from travelator.disagg import wire
from travelator.disagg.link import WORKER, Link, LinkClosed
from travelator.disagg.worker import run_worker
from travelator.engine.control_codec import RefusedMessage
from travelator.engine.tp_launch import LaunchEnv, connect_store, control_secret

if TYPE_CHECKING:
    import torch.distributed as dist

    from travelator.disagg.frontend import DisaggConfig

FRONT_KEY = "disagg/front-end"


def worker_ranks(num_prefill: int, num_decode: int, world_size: int) -> dict[m.WorkerId, int]:
    """The rank each worker runs on: worker i of the P + D (prefill first) on rank
    ``i * world_size // (P + D)``, so each rank runs a run of them (1:1 on two ranks: the
    prefill worker beside the front end, the decode worker on rank 1)."""
    workers = [m.WorkerId(m.PREFILL, i) for i in range(num_prefill)] + \
              [m.WorkerId(m.DECODE, i) for i in range(num_decode)]
    if world_size > len(workers):
        raise ValueError(f"--disaggregate {num_prefill}:{num_decode} has {len(workers)} workers for "
                         f"{world_size} torchrun ranks: every rank runs at least one")
    return {w: i * world_size // len(workers) for i, w in enumerate(workers)}


def publish_front_end(store: dist.Store, host: str, port: int) -> None:
    store.set(FRONT_KEY, f"{host}:{port}")


class FrontEndLink:
    """A worker's connection to the front end, as its command queue (``get``) and its event
    pipe (``send``, ``close``). The end of the connection, or a command it cannot read, reads
    as ``STOP``: without its front end the worker has nobody to serve."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def get(self):
        try:
            return wire.decode_command(self.link.recv_bytes())
        except (LinkClosed, RefusedMessage):
            return m.STOP

    def send(self, event) -> None:
        self.link.send_bytes(wire.encode_event(event))

    def close(self) -> None:
        self.link.shut()


def run_remote_worker(worker: m.WorkerId, host: str, port: int, secret: bytes, threads: int,
                      timeout_s: float) -> None:
    """A worker process on a host other than the front end's (multiprocessing, spawn)."""
    link = Link.open(socket.create_connection((host, port), timeout=timeout_s), secret, WORKER)
    link.send_bytes(wire.encode_hello(worker))
    spec = wire.decode_spec(link.recv_bytes())
    if spec.worker != worker:
        raise RefusedMessage(f"the front end sent the spec of the {spec.worker} to the {worker}")
    spec = dataclasses.replace(spec, threads=threads, parent_pid=os.getppid(), kv_host=link.local_address())
    channel = FrontEndLink(link)
    run_worker(spec, channel, channel)


def run_workers(workers: list[m.WorkerId], host: str, port: int, secret: bytes, threads: int,
                timeout_s: float) -> int:
    """Run ``workers``, a process each, that connect to the front end at ``host:port``, until
    they exit: 0 when every one stopped cleanly. They are this process's children: each exits
    when this process has gone (``tp_worker.watch_parent``)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_remote_worker, name=f"travelator-{w.role}-{w.index}",
                         args=(w, host, port, secret, threads, timeout_s)) for w in workers]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def serve_worker_rank(disagg: DisaggConfig, env: LaunchEnv) -> int:
    """A rank other than 0: run its workers until they exit (0 when every one stopped cleanly)."""
    mine = [w for w, r in worker_ranks(disagg.num_prefill, disagg.num_decode, env.world_size).items()
            if r == env.rank]
    secret = control_secret(env)
    host, port = connect_store(env).get(FRONT_KEY).decode().rsplit(":", 1)
    threads = disagg.threads_per_worker or max(1, (os.cpu_count() or 1) // len(mine))
    return run_workers(mine, host, int(port), secret, threads, disagg.start_timeout_s)
