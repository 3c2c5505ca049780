"""Tensor-parallel tests start worker processes: one torch thread each (two cores here), and a
deadline that turns a hung collective into a failure instead of a stuck run."""

from __future__ import annotations

import signal
from collections.abc import Iterator


def one_thread_per_worker_and_a_deadline(monkeypatch, seconds: int, what: str) -> Iterator[None]:
    """For an autouse fixture: ``yield from`` it."""
    monkeypatch.setenv("TRAVELATOR_TP_THREADS", "1")

    def hung(signum, frame):
        raise TimeoutError(f"{what} hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
