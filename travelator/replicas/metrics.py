"""The front end's Prometheus figures, in its own registry: routing decisions by replica and
reason, and each replica's state (up, restarts, requests in flight). Each replica serves its
own engine's figures on its own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from travelator.replicas.routing import REASONS, PrefixRouter, RouteDecision
from travelator.replicas.supervisor import ReplicaSet


class _ReplicaFigures:
    def __init__(self, replicas: ReplicaSet, router: PrefixRouter) -> None:
        self.replicas, self.router = replicas, router

    def collect(self):
        up = GaugeMetricFamily("travelator_replica_up", "1 while the replica serves, 0 while it "
                               "is down or restarting.", labels=["replica"])
        restarts = CounterMetricFamily("travelator_replica_restarts", "Times the replica was "
                                       "started again after it exited.", labels=["replica"])
        in_flight = GaugeMetricFamily("travelator_replica_in_flight", "Requests sent to the "
                                      "replica and not yet answered.", labels=["replica"])
        for replica in self.replicas.replicas:
            label = [str(replica.index)]
            up.add_metric(label, 1.0 if replica.up else 0.0)
            restarts.add_metric(label, replica.restarts)
            in_flight.add_metric(label, self.router.in_flight[replica.index])
        yield from (up, restarts, in_flight)


class RouteMetrics:
    def __init__(self, replicas: ReplicaSet, router: PrefixRouter) -> None:
        self.registry = CollectorRegistry()
        self._routes = Counter("travelator_route", "Requests routed, by replica and reason: "
                               "prefix (sent where its prefix went before), least_loaded (no "
                               "known prefix), prefix_overloaded (its prefix's replica was busy), "
                               "previous_response (the replica that stored the response it follows).",
                               ["replica", "reason"], registry=self.registry)
        for replica in replicas.replicas:
            for reason in REASONS:
                self._routes.labels(str(replica.index), reason)
        self.registry.register(_ReplicaFigures(replicas, router))

    def routed(self, decision: RouteDecision) -> None:
        self._routes.labels(str(decision.replica), decision.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
