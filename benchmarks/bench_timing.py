"""Timing shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so that
this directory is on the import path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` over ``repeats`` runs, after one run to warm it up."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
