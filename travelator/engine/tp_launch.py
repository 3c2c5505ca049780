"""How the ranks of one tensor-parallel engine find each other: the torchrun-style
environment (set by torchrun, or by the engine's own launcher for workers on this machine),
the rendezvous store it names, from which the group (``model/tp_group.py``) is built, and the
secret every rank proves when the group forms.

A store this module hosts listens on the interface of its address only (torch's own
listens on every interface): 127.0.0.1 for workers on this machine, MASTER_ADDR under
torchrun when rank 0 hosts the store. The secret comes from ``TRAVELATOR_TP_SECRET``, which
must be set when MASTER_ADDR is not a loopback address.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass

import torch.distributed as dist

from travelator.model.tp_group import DATA_TIMEOUT_S

logger = logging.getLogger(__name__)

SECRET_ENV = "TRAVELATOR_TP_SECRET"
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"  # gloo binds this interface, else what the hostname resolves to
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
MIN_SECRET_CHARS = 16


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


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def control_secret(env: LaunchEnv) -> bytes:
    """The secret every rank proves to join the group (``model/tp_auth.py``): required
    unless the store is on a loopback address, where only this machine reaches it."""
    secret = os.environ.get(SECRET_ENV, "")
    if secret and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{SECRET_ENV} must have at least {MIN_SECRET_CHARS} characters")
    if not secret and not is_loopback(env.master_addr):
        raise ValueError(f"tensor parallelism across machines (MASTER_ADDR={env.master_addr}) needs a shared "
                         f"secret: set {SECRET_ENV} to the same random string on every rank "
                         f"(e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    if not secret:
        logger.warning("%s is not set: the tensor-parallel control messages are not authenticated "
                       "(any local user can reach %s:%d)", SECRET_ENV, env.master_addr, env.master_port)
    return secret.encode()


def host_store(host: str, port: int, world_size: int, timeout_s: float = DATA_TIMEOUT_S) -> dist.TCPStore:
    """A rendezvous store listening on ``host``'s interface only (port 0: a free one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def connect_store(env: LaunchEnv, timeout_s: float = DATA_TIMEOUT_S) -> dist.Store:
    """The rendezvous store of ``env``: hosted by rank 0 on MASTER_ADDR, or torchrun's agent
    store when it hosts one."""
    if env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        store: dist.Store = host_store(env.master_addr, env.master_port, env.world_size, timeout_s)
    else:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore("travelator/", store)


def interface_with_address(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address is ``address``
    (None when none is): what gloo must bind so that ranks on other hosts reach this one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None
