"""The planning answer: the highest request rate whose simulated run meets latency targets.

``--slo ttft_p99=2s,tpot_p99=100ms`` names a percentile of a latency metric and its limit.
The search assumes that latency does not fall as the rate rises (true of a queue fed the
same arrival pattern faster): it doubles the rate until the targets fail, then bisects
between the last rate that met them and the first that did not, on a log scale.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_METRICS = ("ttft", "tpot", "itl", "e2el")
_SLO_ITEM = re.compile(r"^(ttft|tpot|itl|e2el|e2e)_(p\d{1,2}|mean|median)=([0-9.]+)(ms|s)$")


def parse_slo_targets(text: str) -> dict[str, float]:
    """``ttft_p99=2s,tpot_p99=100ms`` -> ``{"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}``: the keys
    of ``compute_metrics``' result and their limits in milliseconds."""
    targets: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = _SLO_ITEM.match(item)
        if m is None:
            raise ValueError(f"bad SLO {item!r}: expected METRIC_STAT=VALUE(ms|s), METRIC one of "
                             f"{', '.join(_METRICS)}, STAT p50/p90/p99/mean/median, e.g. ttft_p99=2s")
        metric, stat, value, unit = m.groups()
        metric = "e2el" if metric == "e2e" else metric
        stat = "median" if stat == "p50" else stat
        if stat.startswith("p") and int(stat[1:]) not in (90, 99):
            raise ValueError(f"bad SLO {item!r}: the percentiles reported are p50, p90 and p99")
        targets[f"{stat}_{metric}_ms"] = float(value) * (1000.0 if unit == "s" else 1.0)
    if not targets:
        raise ValueError("give at least one SLO, e.g. ttft_p99=2s")
    return targets


def meets_targets(metrics: dict, targets: dict[str, float]) -> bool:
    """Every request completed and every named statistic is within its limit (a statistic
    nobody had, such as TPOT of one-token outputs, holds no limit)."""
    if metrics["failed"]:
        return False
    return all(metrics.get(k) is None or metrics[k] <= limit for k, limit in targets.items())


@dataclass(slots=True)
class RateSearch:
    max_rate: float | None  # the highest rate found that meets the targets (None: not even the lowest)
    first_failing: float | None  # the lowest rate found that does not (None: none up to the cap)
    tried: list[tuple[float, bool]] = field(default_factory=list)  # (rate, met), in order


def find_max_rate(meets: Callable[[float], bool], *, start: float = 1.0, rel_tol: float = 0.02,
                  min_rate: float = 1e-3, max_rate: float = 1e6) -> RateSearch:
    """Bracket the boundary by doubling (or halving) from ``start``, then bisect it until the
    two rates are within ``rel_tol`` of each other."""
    if not 0 < min_rate <= start <= max_rate or rel_tol <= 0:
        raise ValueError("need 0 < min_rate <= start <= max_rate and rel_tol > 0")
    search = RateSearch(None, None)

    def test(rate: float) -> bool:
        ok = meets(rate)
        search.tried.append((rate, ok))
        if ok:
            search.max_rate = max(search.max_rate or 0.0, rate)
        else:
            search.first_failing = rate if search.first_failing is None else min(search.first_failing, rate)
        return ok

    rate = start
    if test(rate):
        while search.first_failing is None and rate < max_rate:
            rate = min(rate * 2, max_rate)
            test(rate)
    else:
        while search.max_rate is None and rate > min_rate:
            rate = max(rate / 2, min_rate)
            test(rate)
    lo, hi = search.max_rate, search.first_failing
    while lo is not None and hi is not None and hi > lo * (1 + rel_tol):
        test(math.sqrt(lo * hi))
        lo, hi = search.max_rate, search.first_failing
    return search
