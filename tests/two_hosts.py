"""Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own
address, so a test's processes reach each other only over that link, as on two machines.

Needs root (``ip netns``); ``two_hosts()`` skips the test with the reason where namespaces
cannot be made. Everything made is removed when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


# The start of a client script run on one host: ``wait_for(url)`` returns once the server
# there answers /health with 200, and fails the script after ``seconds``.
WAIT_FOR_SERVER = """
import time, httpx
def wait_for(url, seconds=240):
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.3)
"""


@dataclass(frozen=True, slots=True)
class Host:
    namespace: str
    address: str
    interface: str

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside this host's namespace, with ``env`` added to the environment."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.namespace, "env", *extra, *argv]

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on this host's end of the link."""
        base = f"/sys/class/net/{self.interface}/statistics"
        out = subprocess.run(["ip", "netns", "exec", self.namespace, "cat", f"{base}/rx_bytes", f"{base}/tx_bytes"],
                             check=True, capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts need network namespaces: root and iproute2's ip")
    tag = f"tv{os.getpid() % 100000}"
    subnet = f"10.{77 + os.getpid() % 100}.{os.getpid() // 100 % 250}"
    hosts = (Host(f"{tag}a", f"{subnet}.1", f"{tag}a0"), Host(f"{tag}b", f"{subnet}.2", f"{tag}b0"))
    made: list[str] = []
    try:
        try:
            for h in hosts:
                _ip("netns", "add", h.namespace)
                made.append(h.namespace)
            _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
            for h in hosts:
                _ip("link", "set", h.interface, "netns", h.namespace)
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface)
                _ip("-n", h.namespace, "link", "set", h.interface, "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"network namespaces cannot be made here: {exc.stderr.strip()}")
        yield hosts
    finally:
        for name in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
