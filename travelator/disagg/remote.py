"""The front end's side of workers on other hosts.

A ``RemoteWorker`` is seen through its connection (``link.py``) as a local worker is seen
through its process, its command queue and its event pipe, so the front end treats both alike:
``put`` sends a command, ``recv`` reads an event, and the worker is alive while the connection
is open (``sentinel`` becomes readable when it closes). ``accept_workers`` takes the expected
workers' connections as they come, each proving the secret and naming itself, and sends each
its spec.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from travelator.disagg import messages as m
from travelator.disagg import wire
from travelator.disagg.link import FRONT_END, Link, LinkClosed
from travelator.disagg.worker import DisaggWorkerSpec
from travelator.engine.control_codec import RefusedMessage

logger = logging.getLogger(__name__)


class RemoteWorker:
    """A worker on another host, through its connection."""

    def __init__(self, worker: m.WorkerId, link: Link, address: str) -> None:
        self.worker = worker
        self.link = link
        self.address = address
        self.why: str | None = None  # why the connection ended (None: open)
        self._closed = threading.Event()
        self.sentinel, self._alive_end = os.pipe()  # the sentinel reads EOF once _alive_end closes
        self._lock = threading.Lock()

    # ---- as its command queue ------------------------------------------------------------
    def put(self, command) -> None:
        try:
            self.link.send_bytes(wire.encode_command(command))
        except LinkClosed as exc:
            self.lost(str(exc))

    # ---- as its event pipe -----------------------------------------------------------------
    def fileno(self) -> int:
        return self.link.fileno()

    def recv(self):
        """The worker's next event; ``EOFError`` once the connection has ended."""
        try:
            event = wire.decode_event(self.link.recv_bytes())
        except (LinkClosed, RefusedMessage) as exc:
            self.lost(f"its connection from {self.address} ended: {exc}")
            raise EOFError(str(exc)) from None
        if isinstance(event, m.Report):
            _to_local_clock(event, time.monotonic() - event.clock)
        return event

    def close(self) -> None:
        self.link.close()

    # ---- as its process ------------------------------------------------------------------
    def is_alive(self) -> bool:
        return not self._closed.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._closed.wait(timeout)

    def kill(self) -> None:
        self.lost("stopped by the front end")

    def lost(self, why: str) -> None:
        """End the connection: the worker is gone (the first reason given stays)."""
        with self._lock:
            if self._closed.is_set():
                return
            self.why = why
            self.link.shut()  # the event reader sees the end and closes the socket
            os.close(self._alive_end)
            self._closed.set()


def _to_local_clock(report: m.Report, offset: float) -> None:
    """Move the outputs' moments from the worker's monotonic clock onto this host's (the offset
    counts the report's time in flight: moments come out at most that much late)."""
    for out in report.outputs:
        t = out.times
        if t is None:
            continue
        t.arrival += offset
        for name in ("queued", "first_scheduled", "first_token", "last_token", "finished"):
            value = getattr(t, name)
            if value is not None:
                setattr(t, name, value + offset)


def accept_workers(listener: socket.socket, expected: set[m.WorkerId], secret: bytes,
                   spec_of: Callable[[m.WorkerId], DisaggWorkerSpec], timeout_s: float,
                   check: Callable[[], None] | None = None) -> dict[m.WorkerId, RemoteWorker]:
    """The connections of the ``expected`` workers, each sent its spec. A connection that does
    not prove the secret or names a worker not expected (or one already here) is closed, and
    the others are still waited for. ``check``, called about once a second while waiting,
    raises when a worker can no longer come (its Ray actor ended)."""
    got: dict[m.WorkerId, RemoteWorker] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(expected):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(str(w) for w in expected - set(got))
            raise TimeoutError(f"the workers on other hosts did not connect in {timeout_s} s: {missing}")
        if check is not None:
            check()
            left = min(left, 1.0)
        listener.settimeout(left)
        try:
            sock, peer = listener.accept()
        except socket.timeout:
            continue
        address = peer[0]
        try:
            link = Link.open(sock, secret, FRONT_END)
            worker = wire.decode_hello(link.recv_bytes())
            if worker not in expected or worker in got:
                raise RefusedMessage(f"{worker} is not a worker this server waits for")
            link.send_bytes(wire.encode_spec(spec_of(worker)))
        except (LinkClosed, RefusedMessage) as exc:
            logger.warning("refused a worker connection from %s: %s", address, exc)
            sock.close()
            continue
        logger.info("the %s connected from %s", worker, address)
        got[worker] = RemoteWorker(worker, link, address)
    return got
