"""Ranks 1..N-1 of a tensor- or pipeline-parallel engine as Ray actors
(``--distributed-executor-backend ray``), placed by a Ray cluster the user already runs.

The driver (rank 0, the engine process) joins the cluster (``RAY_ADDRESS``, else the one
running on this machine) and reserves a placement group of one CPU bundle per rank, the first
on its own node (as vLLM's Ray executor does), so that the cluster hands out every rank's
cores at once or not at all. Each other rank is an actor in its bundle that runs the usual
worker loop (``tp_worker.run_worker``): the same rendezvous store, now hosted on the driver
node's IP, the same fresh secret and signed control messages, the same gloo groups, bound to
the interface that carries the actor's own node IP. The engine above is unchanged.

A ``RayRank`` answers the part of ``subprocess.Popen`` the executor uses (``poll``, ``wait``,
``terminate``, ``kill``, ``pid``), so a dead actor fails the engine as a dead local worker does;
``RayPlacement.release`` removes the group when the engine stops. If the driver itself dies,
Ray ends the job's actors and group.

``ActorGroup`` (join, reserve a group, start actors in its bundles, release) is shared with
the disaggregated server's workers placed by Ray (``disagg/ray_workers.py``).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from travelator.engine.tp_launch import GLOO_INTERFACE_ENV, SECRET_ENV, host_store, interface_with_address

logger = logging.getLogger(__name__)

# How long the cluster may take to grant the whole group before the engine gives up.
GROUP_TIMEOUT_S = float(os.environ.get("TRAVELATOR_RAY_GROUP_TIMEOUT", "120"))
THREADS_ENV = "TRAVELATOR_TP_THREADS"  # CPUs of each rank's bundle, and its torch threads


class RayPlacementError(ValueError):
    """The Ray cluster cannot hold the engine's ranks (no Ray, no cluster, too few CPUs)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayPlacementError("--distributed-executor-backend ray needs Ray in this environment "
                                "(pip install 'ray>=2.9') and a running Ray cluster") from exc
    return ray


def join_cluster() -> bool:
    """Connect this process to the Ray cluster; True when it was not connected before (then
    ``release`` disconnects it again)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "auto")
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise RayPlacementError(f"no Ray cluster to join at {address!r} ({exc}): start one with `ray start "
                                "--head` on this host (and `ray start --address=HEAD:6379` on the "
                                "others), or set RAY_ADDRESS to its head") from exc
    return True


class PlacedActor:
    """What every actor placed here answers first: where it runs (``ray.remote`` is applied
    when Ray is loaded)."""

    def where(self) -> tuple[str, int]:
        """This actor's node IP and process id."""
        return _ray().util.get_node_ip_address(), os.getpid()


class RankActor(PlacedActor):
    """The body of a worker rank's actor."""

    def serve(self, environment: dict[str, str]) -> int:
        """Run the worker loop until the driver says stop; this process is the actor's alone,
        so its environment is the rank's."""
        from travelator.engine.tp_worker import run_worker

        os.environ.update(environment)
        bind_node_interface(self.where()[0])
        run_worker()
        return 0


def bind_node_interface(node_ip: str) -> None:
    """Have gloo bind the interface that carries ``node_ip`` (unless ``GLOO_SOCKET_IFNAME``
    is set): the one the other nodes reach this one through."""
    interface = interface_with_address(node_ip)
    if interface is not None:
        os.environ.setdefault(GLOO_INTERFACE_ENV, interface)


def why_it_ended(exc: BaseException, most: int = 200) -> str:
    """What an actor call's error says, short: its last line (Ray's say how, then what may
    have caused it at length), at most ``most`` characters."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return line if len(line) <= most else line[:most - 3].rstrip() + "..."


@dataclass(slots=True)
class RayRank:
    """A worker rank's actor, seen through the part of ``subprocess.Popen`` the executor uses."""

    rank: int
    actor: Any
    done: Any  # the ObjectRef of ``serve``: ready when the loop ends, an error if the actor died
    node_ip: str
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        ray = _ray()
        if self.returncode is None and (not ray.is_initialized() or ray.wait([self.done], timeout=0)[0]):
            self.returncode = self._exit_code(ray)
        return self.returncode

    def _exit_code(self, ray: Any) -> int:
        if not ray.is_initialized():  # the job is over: Ray has ended its actors
            return 1
        try:
            return ray.get(self.done)
        except Exception as exc:  # the loop raised, or the actor's process died
            logger.error("tensor-parallel rank %d (Ray actor on %s, pid %d) ended: %s", self.rank,
                         self.node_ip, self.pid, why_it_ended(exc))
            return 1

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"Ray actor of rank {self.rank}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode

    def terminate(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)

    kill = terminate


@dataclass(slots=True)
class RayPlacement:
    """What the driver gets: the worker ranks, its end of the rendezvous, and the clean-up."""

    ranks: list[RayRank]
    server: dist.TCPStore  # lives as long as the group
    store: dist.Store
    secret: bytes
    release: Callable[[], None]


def rank_cpus() -> int:
    """The CPUs of each rank's bundle, and its torch threads."""
    return int(os.environ.get(THREADS_ENV, "1"))


class ActorGroup:
    """A placement group of the cluster this process joins, and the actors started in its
    bundles (shared by the ranks here and by ``disagg/ray_workers.py``). ``release`` kills the
    actors, removes the group and, when joining connected this process, leaves the cluster."""

    def __init__(self) -> None:
        self.owned = join_cluster()
        self.ray = _ray()
        self.driver_ip = self.ray.util.get_node_ip_address()
        self.group: Any = None
        self.actors: list[Any] = []

    def reserve(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float, layout: str,
                smaller: str) -> None:
        """Wait up to ``timeout_s`` for the cluster to grant ``bundles`` at once; else say what
        is missing (``layout``: how the bundles are laid out; ``smaller``: how to ask for less)."""
        ray = self.ray
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(bundles, strategy=strategy)
        if ray.wait([group.ready()], timeout=timeout_s)[0]:
            self.group = group
            return
        remove_placement_group(group)
        per_node = {n["NodeManagerAddress"]: f"{n['Resources'].get('CPU', 0):g}" for n in ray.nodes() if n["Alive"]}
        raise RayPlacementError(
            f"the Ray cluster did not grant the placement group within {timeout_s:g} s: {len(bundles)} bundles of "
            f"{bundles[0]['CPU']:g} CPU(s), {layout}, {sum(b['CPU'] for b in bundles):g} CPUs in all; the cluster "
            f"has {ray.cluster_resources().get('CPU', 0):g} CPUs (per node: {per_node}), "
            f"{ray.available_resources().get('CPU', 0):g} free: add nodes or CPUs, or {smaller}")

    def start(self, body: type, bundle: int, cpus: float) -> Any:
        """An actor running ``body`` in bundle ``bundle``, with this driver's code (its sys.path)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        path = [p for p in sys.path if p]
        if os.environ.get("PYTHONPATH"):
            path.insert(0, os.environ["PYTHONPATH"])
        actor = self.ray.remote(body).options(
            num_cpus=cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(path)}},
        ).remote()
        self.actors.append(actor)
        return actor

    def locate(self, actors: list[Any], names: list[str]) -> list[tuple[str, int]]:
        """Each ``PlacedActor``'s node IP and pid, once all have started (they start at once)."""
        ray = self.ray
        refs = [a.where.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=GROUP_TIMEOUT_S)
        if len(ready) < len(refs):
            late = [name for name, ref in zip(names, refs) if ref not in ready]
            raise RayPlacementError(f"the Ray actors of {', '.join(late)} did not start within {GROUP_TIMEOUT_S:g} s "
                                    "(their nodes' logs are under the session's logs/ folder)")
        return ray.get(refs)

    def release(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
            logger.info("killed %d Ray actors and removed their placement group", len(self.actors))
        if self.owned:
            ray.shutdown()


def place_ranks(size: int, device_type: str, timeout_s: float = GROUP_TIMEOUT_S) -> RayPlacement:
    """Join the cluster, reserve the group and start ranks 1..size-1 in it."""
    if device_type != "cpu":
        raise RayPlacementError("--distributed-executor-backend ray places CPU ranks only for now "
                                "(use torchrun for GPU ranks on several machines)")
    group = ActorGroup()
    driver_ip, cpus = group.driver_ip, rank_cpus()
    try:
        # A sliver of the node's own resource pins bundle 0, the driver's cores, to the driver's node.
        bundles = [{"CPU": cpus, f"node:{driver_ip}": 0.001}] + [{"CPU": cpus} for _ in range(size - 1)]
        group.reserve(bundles, "PACK", timeout_s, f"one per rank, the first on the driver's node {driver_ip}",
                       f"lower {THREADS_ENV}")
        bind_node_interface(driver_ip)  # the driver's groups, reachable from the others
        server = host_store(driver_ip, 0, size)
        secret = secrets.token_hex(32)
        environment = {"WORLD_SIZE": str(size), "LOCAL_RANK": "0", "MASTER_ADDR": driver_ip,
                       "MASTER_PORT": str(server.port), SECRET_ENV: secret, THREADS_ENV: str(cpus)}
        actors = [group.start(RankActor, rank, cpus) for rank in range(1, size)]
        ranks = []
        for rank, actor, (node_ip, pid) in zip(range(1, size), actors,
                                                group.locate(actors, [f"rank {r}" for r in range(1, size)])):
            logger.info("tensor parallel: rank %d on Ray node %s (pid %d)", rank, node_ip, pid)
            ranks.append(RayRank(rank, actor, actor.serve.remote({**environment, "RANK": str(rank)}), node_ip, pid))
    except BaseException:
        group.release()
        raise
    return RayPlacement(ranks, server, dist.PrefixStore("travelator/", server), secret.encode(), group.release)
