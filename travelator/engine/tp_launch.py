"""How the ranks of one tensor-parallel engine find each other: the torchrun-style
environment (set by torchrun, or by the engine's own launcher for workers on this machine)
and the rendezvous store it names, from which the group (``model/tp_group.py``) is built.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from travelator.model.tp_group import DATA_TIMEOUT_S


@dataclass(slots=True)
class LaunchEnv:
    """What torchrun (or the engine's own launcher) puts in the environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env() -> LaunchEnv | None:
    """The torchrun-style environment, or None when the process was not launched so."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return LaunchEnv(rank, world, int(env.get("LOCAL_RANK", rank)), env["MASTER_ADDR"],
                     int(env["MASTER_PORT"]))


def connect_store(env: LaunchEnv, timeout_s: float = DATA_TIMEOUT_S) -> dist.Store:
    """The rendezvous store of ``env`` (torchrun's agent store when it hosts one)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(
        f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}",
        timeout=timeout))
    return dist.PrefixStore("travelator/", store)
