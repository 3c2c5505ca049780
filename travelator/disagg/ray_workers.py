"""Disaggregated workers placed by Ray (``serve --disaggregate P:D
--distributed-executor-backend ray``), as the ranks of a parallel engine are
(``engine/ray_placement.py``), in place of torchrun's ranks (``hosts.py``).

The front end joins the cluster (``RAY_ADDRESS``, else the one running on this machine) and
reserves one placement group of a bundle per worker (``--worker-threads`` CPUs each, 1 by
default: the worker's torch threads), ``SPREAD`` over the nodes, so that the cluster grants
every worker's cores at once or not at all. Each worker then runs in an actor of its bundle,
every one of them, those that land on the front end's node too. Keeping the front end's own
workers as local processes would save one connection per worker on its node, but it would
need to know before the group is granted which bundles the cluster puts there, and it would
keep two kinds of worker with two ways to start, watch and stop them; with every worker an
actor there is one path, the one torchrun's remote workers already take: the actor starts the
worker as its child process (``hosts.run_workers``), which connects to the front end, proves
a fresh secret (handed to the actors by Ray, as the ranks' is) and serves over its own signed
connection (``link.py``, ``wire.py``: HMAC'd msgpack, no pickles). Its gloo KV pairs bind the
address it reaches the front end from, which is its node's on the front end's network.

The worker is the actor's child, not the actor itself, because a worker owns its process (it
ends it with ``os._exit``, sets its signals and threads), and the actor outlives it to report
its exit. A dead actor is a dead worker: the front end watches each actor's call and, when one
ends, closes that worker's connection, so its requests fail as a dead remote worker's do under
torchrun (``/health`` degraded, or the engine dead when no worker of a role is left), even
when the worker's process lives on, stuck. Ray's raylet kills a dead actor's children by
default, and else the child exits within a second of its actor (``tp_worker.watch_parent``).
Stopping the front end stops the workers, kills the actors and removes the group.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import TYPE_CHECKING, Any

from travelator.disagg import messages as m
from travelator.engine.ray_placement import GROUP_TIMEOUT_S, ActorGroup, PlacedActor, why_it_ended

if TYPE_CHECKING:
    from travelator.disagg.remote import RemoteWorker

logger = logging.getLogger(__name__)


class WorkerActor(PlacedActor):
    """The body of a worker's actor."""

    def serve(self, worker: m.WorkerId, host: str, port: int, secret: bytes, threads: int,
              timeout_s: float) -> int:
        """Run the worker in a child process that connects to the front end at ``host:port``,
        until it exits; its exit code."""
        from travelator.disagg.hosts import run_workers

        return run_workers([worker], host, port, secret, threads, timeout_s)


class RayWorkers:
    """The workers' actors in their placement group; ``host``, the front end node's IP."""

    def __init__(self, workers: list[m.WorkerId], cpus: int, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.cpus = cpus
        self.secret = secrets.token_hex(32).encode()
        self._group = ActorGroup()
        self.host = self._group.driver_ip
        self._calls: dict[Any, m.WorkerId] = {}  # each actor's serve call -> its worker
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            self._group.reserve([{"CPU": cpus} for _ in workers], "SPREAD", timeout_s, "one per worker",
                                 "lower --worker-threads")
            self.actors = {w: self._group.start(WorkerActor, i, cpus) for i, w in enumerate(workers)}
            places = self._group.locate(list(self.actors.values()), [str(w) for w in workers])
        except BaseException:
            self._group.release()
            raise
        self.nodes = {w: ip for w, (ip, _) in zip(workers, places)}
        for w, (ip, pid) in zip(workers, places):
            logger.info("disaggregation: the %s on Ray node %s (actor pid %d)", w, ip, pid)

    def start(self, port: int, timeout_s: float) -> None:
        """Start each worker: it connects to the front end at ``host:port``."""
        for w, actor in self.actors.items():
            self._calls[actor.serve.remote(w, self.host, port, self.secret, self.cpus, timeout_s)] = w

    def check(self) -> None:
        """Raise when a worker's actor has ended (while the front end waits for the workers)."""
        ray = self._group.ray
        ended, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)
        if ended:
            worker = self._calls[ended[0]]
            raise RuntimeError(f"the {worker} ended before it was ready ({self._why(ended[0])})")

    def watch(self, remote: dict[m.WorkerId, RemoteWorker]) -> None:
        """From now on, a worker whose actor ends is lost: its connection is closed."""
        self._watcher = threading.Thread(target=self._watch, args=(remote,), name="travelator-ray-watch",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, remote: dict[m.WorkerId, RemoteWorker]) -> None:
        ray = self._group.ray
        pending = dict(self._calls)
        while pending and not self._stopping.is_set():
            ended, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
            for ref in ended:
                worker = pending.pop(ref)
                remote[worker].lost(f"its Ray actor on {self.nodes[worker]} ended: {self._why(ref)}")

    def _why(self, call: Any) -> str:
        try:
            return f"its worker exited with code {self._group.ray.get(call)}"
        except Exception as exc:  # the actor's process died, or the call raised
            return why_it_ended(exc)

    def release(self) -> None:
        """Kill the actors (their workers follow) and remove the group."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(2.0)
        self._group.release()
