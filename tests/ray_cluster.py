"""A Ray cluster on the two hosts of ``two_hosts``: a head node on the first, a worker node
on the second, each with a few logical CPUs, started and stopped here. A process run with
``RAY_ADDRESS`` = ``address(first)`` (in the first host's namespace) joins it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from two_hosts import Host, two_hosts

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT = 6379


def address(head: Host) -> str:
    return f"{head.address}:{PORT}"


def _node_flags(cpus: int) -> list[str]:
    return ["--block", "--num-cpus", str(cpus), "--disable-usage-stats", "--object-store-memory", str(80 * 2**20)]


def _start_node(host: Host, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    """A Ray node in ``host``'s namespace, in a session of its own, once it is up."""
    node = subprocess.Popen(host.command([RAY, "start", *argv], env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in node.stdout:
        seen.append(line)
        if "Ray runtime started" in line:
            return node
    _stop_nodes([node])
    raise RuntimeError(f"ray start failed on {host.address}:\n{''.join(seen)[-3000:]}")


def _stop_nodes(nodes: list[subprocess.Popen]) -> None:
    """End each node's session (the processes its `ray start --block` started): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, sig)
        deadline = time.monotonic() + wait_s
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(node.poll() is not None for node in nodes):
            return


@contextlib.contextmanager
def ray_cluster(cpus: int = 1, env: dict[str, str] | None = None) -> Iterator[tuple[Host, Host]]:
    """Two hosts, and a Ray cluster of one ``cpus``-CPU node on each, ``env`` added to the
    nodes' environment (skips where namespaces cannot be made)."""
    with two_hosts() as (first, second):
        temp = tempfile.mkdtemp(prefix="tvray")
        nodes = []
        try:
            nodes.append(_start_node(first, [*_node_flags(cpus), "--head", "--node-ip-address", first.address,
                                             "--port", str(PORT), "--include-dashboard=false", "--temp-dir", temp], env))
            nodes.append(_start_node(second, [*_node_flags(cpus), "--address", address(first),
                                              "--node-ip-address", second.address], env))
            yield first, second
        finally:
            _stop_nodes(nodes)
            shutil.rmtree(temp, ignore_errors=True)
