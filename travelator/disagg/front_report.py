"""What the disaggregated front end reports of its workers, added up or one by one: the
``EngineSnapshot`` (the server's gauges and counters), the self-check report (in the shape of
the single engine's), and per-worker Prometheus figures.

Everything here reads the workers' latest reports (``DisaggregatedFrontEnd.stats``) and the
router's maps, on the event loop's thread; a dead worker's last report no longer counts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from travelator.disagg import messages as m
from travelator.engine.client import EngineCounters, EngineSnapshot

if TYPE_CHECKING:
    from travelator.disagg.frontend import DisaggregatedFrontEnd


def front_snapshot(front: DisaggregatedFrontEnd) -> EngineSnapshot:
    """The live workers' queues, KV pools and prefix caches added up, and every worker's counters."""
    live = front.live_stats()
    return EngineSnapshot(
        num_running=sum(s.running for s in live),
        num_waiting=len(front.router.waiting) + sum(s.waiting + s.pending_handoffs for s in live),
        num_in_flight=front.num_in_flight,
        kv_total_blocks=sum(s.total_blocks for s in live),
        kv_used_blocks=sum(s.used_blocks for s in live),
        kv_free_blocks=sum(s.free_blocks for s in live),
        kv_cached_blocks=sum(s.cached_blocks for s in live),
        prefix_queried_tokens=sum(s.prefix_queried_tokens for s in live),
        prefix_hit_tokens=sum(s.prefix_hit_tokens for s in live),
        counters=_counters(front),
    )


def _counters(front: DisaggregatedFrontEnd) -> EngineCounters:
    c = EngineCounters(finished=dict(front.router.finished))
    for worker, s in front.stats.items():
        w = s.counters
        if worker.role == m.PREFILL:  # a decode worker counts a handed-off prompt again
            c.prompt_tokens += w["prompt_tokens"]
        c.computed_prompt_tokens += w["computed_prompt_tokens"]
        c.generation_tokens += w["generation_tokens"]
        c.preemptions += w["preemptions"]
        c.steps += w["steps"]
        c.draft_tokens += w["draft_tokens"]
        c.accepted_draft_tokens += w["accepted_draft_tokens"]
        c.speculative_steps += w["speculative_steps"]
    return c


def combine_reports(front: DisaggregatedFrontEnd, reports: dict[m.WorkerId, dict]) -> dict:
    """Every live worker's ``engine_self_check`` and the front end's own maps, in the shape of
    the single engine's report (KV and requests added up over the workers that answered)."""
    problems = [f"{w}: {p}" for w, r in reports.items() for p in r["problems"]]
    router = front.router
    idle = all(r["idle"] for r in reports.values()) and not router.routes and not front.num_in_flight
    return {
        "ok": not problems, "problems": problems, "idle": idle, "kv": _kv_report(front, reports),
        "requests": _requests_report(front, reports),
        "detokenizers": sum(r["detokenizers"] for r in reports.values()),
        "healthy": front.healthy, "error": None if front.error is None else repr(front.error),
        "degraded": front.degraded, "streams": front.num_in_flight, "routes": len(router.routes),
        "step_running_for_s": 0.0,
        "workers": {str(w): {"pid": front.pids[w], "alive": w not in front.dead, **reports.get(w, {})}
                    for w in front.workers},
        "oldest_routes": [
            {"id": rid, "stage": r.stage, "prefill": r.prefill, "decode": r.decode,
             "age_s": round(time.monotonic() - r.request.times.arrival, 1)}
            for rid, r in sorted(router.routes.items(), key=lambda kv: kv[1].request.times.arrival)[:5]],
        "placement": {
            "prefill": [{"alive": p.alive, "pending": len(p.pending), "tokens": p.tokens}
                        for p in router.placement.prefill],
            "decode": [{"alive": d.alive, "free_blocks": d.free_blocks, "running": d.running,
                        "promised": len(d.promised), "room": d.room} for d in router.placement.decode],
        },
    }


def _kv_report(front: DisaggregatedFrontEnd, reports: dict[m.WorkerId, dict]) -> dict:
    kv_keys = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "leaked_blocks")
    kv = {k: sum(r["kv"][k] for r in reports.values()) for k in kv_keys}
    kv["block_size"] = front.block_size
    kv["free_plus_used_equals_total"] = all(r["kv"]["free_plus_used_equals_total"] for r in reports.values())
    kv["owners"] = {f"{w}: {rid}": n for w, r in reports.items() for rid, n in r["kv"]["owners"].items()}
    bad = [f"{w}: {r['kv']['consistency']}" for w, r in reports.items() if r["kv"]["consistency"] != "ok"]
    kv["consistency"] = "ok" if not bad else "; ".join(bad)
    return kv


def _requests_report(front: DisaggregatedFrontEnd, reports: dict[m.WorkerId, dict]) -> dict:
    req_keys = ("running", "waiting", "unfinished")
    requests = {k: sum(r["requests"][k] for r in reports.values()) for k in req_keys}
    requests["waiting"] += len(front.router.waiting)
    for k in ("running_ids", "waiting_ids"):
        requests[k] = [i for r in reports.values() for i in r["requests"][k]]
    requests["waiting_ids"] += list(front.router.waiting)
    return requests


class WorkerMetrics:
    """Per-worker figures, labelled by role and index: a Prometheus collector that the server's
    metrics register (``EngineClient.metric_collectors``)."""

    def __init__(self, front: DisaggregatedFrontEnd) -> None:
        self.front = front

    def collect(self):
        front = self.front
        labels = ["role", "index"]

        def family(kind, name: str, doc: str, value):
            fam = kind(f"travelator_disagg_{name}", doc, labels=labels)
            for w in front.workers:
                s = front.stats.get(w)
                fam.add_metric([w.role, str(w.index)], value(w, s))
            return fam

        yield family(GaugeMetricFamily, "worker_alive", "1 while the worker runs.",
                     lambda w, s: 0.0 if w in front.dead else 1.0)
        yield family(GaugeMetricFamily, "worker_running", "Requests in the worker's running batch.",
                     lambda w, s: s.running if s else 0)
        yield family(GaugeMetricFamily, "worker_waiting", "Requests waiting in the worker (hand-offs waiting "
                     "for room included).", lambda w, s: (s.waiting + s.pending_handoffs) if s else 0)
        yield family(GaugeMetricFamily, "worker_kv_cache_usage", "Share of the worker's KV blocks in use.",
                     lambda w, s: s.used_blocks / s.total_blocks if s and s.total_blocks else 0.0)
        yield family(CounterMetricFamily, "kv_transfers", "KV hand-offs sent (prefill) or received (decode).",
                     lambda w, s: s.transfers if s else 0)
        yield family(CounterMetricFamily, "kv_transfer_bytes", "Bytes of KV sent (prefill) or received (decode).",
                     lambda w, s: s.transfer_bytes if s else 0)
        yield family(CounterMetricFamily, "kv_transfer_seconds", "Seconds spent moving KV, from the first byte.",
                     lambda w, s: s.transfer_seconds if s else 0.0)
        waiting = GaugeMetricFamily("travelator_disagg_front_waiting",
                                    "Requests the front end holds back until a decode worker has room.")
        waiting.add_metric([], len(front.router.waiting))
        yield waiting
