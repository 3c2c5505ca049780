"""Simulated runs of one workload over request rates and batching modes, reported as
``bench serve`` and ``bench compare`` report real ones (the same metric keys and tables)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from travelator.bench.arrivals import arrival_times
from travelator.bench.metrics import compute_metrics
from travelator.bench.workloads import Workload
from travelator.sim.cost_model import CostModel
from travelator.sim.find_rate import RateSearch, find_max_rate, meets_targets
from travelator.sim.disagg import DisaggregatedSimulation, HandoffTime
from travelator.sim.simulator import SimSetup, Simulation


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Poisson (burstiness 1) or gamma arrivals from a seed, or a trace's own times."""

    burstiness: float = 1.0
    seed: int = 0
    trace_times: np.ndarray | None = None

    def at(self, rate: float | None, n: int) -> np.ndarray:
        if self.trace_times is not None:
            return self.trace_times
        return arrival_times(n, rate, burstiness=self.burstiness, seed=self.seed)


# The mode that splits prefill and decode over two pools, each running iteration-level batching.
DISAGGREGATED = "disaggregated"


def simulate_once(setup: SimSetup, cost: CostModel, workload: Workload, arrivals: np.ndarray,
                  slo: dict[str, float] | None = None, handoff: HandoffTime | None = None) -> dict:
    """One run on a fresh engine state: ``compute_metrics``' keys and the step summary's.
    With ``handoff``, prefill and decode run in two pools of ``setup`` each (DistServe)."""
    if handoff is None:
        run = Simulation(setup, cost).run(workload, arrivals)
    else:
        run = DisaggregatedSimulation(Simulation(setup, cost), Simulation(setup, cost), handoff).run(workload, arrivals)
    return {**compute_metrics(run.results, run.duration_s, slo), **run.step_summary(),
            "_steps": run.steps_as_lists()}


def with_batching(setup: SimSetup, mode: str) -> SimSetup:
    return dataclasses.replace(setup, scheduler=dataclasses.replace(setup.scheduler, batching=mode))


def sweep(setup: SimSetup, cost: CostModel, workload: Workload, arrivals: Arrivals,
          rates: list[float | None], modes: list[str], slo: dict[str, float] | None = None,
          handoff: HandoffTime | None = None) -> list[dict]:
    """A row per (rate, mode), as ``bench compare``'s rows: rate, scheduler, metrics, steps.
    The ``disaggregated`` mode needs ``handoff``."""
    rows = []
    for rate in rates:
        times = arrivals.at(rate, len(workload))
        for mode in modes:
            split = mode == DISAGGREGATED
            if split and handoff is None:
                raise ValueError("the disaggregated mode needs the KV hand-off's time")
            m = simulate_once(with_batching(setup, "iteration" if split else mode), cost, workload, times, slo,
                              handoff if split else None)
            rows.append({"rate": rate, "scheduler": mode, **m})
    return rows


def search_max_rate(setup: SimSetup, cost: CostModel, workload: Workload, arrivals: Arrivals,
                    targets: dict[str, float], start: float = 1.0, handoff: HandoffTime | None = None) -> RateSearch:
    def meets(rate: float) -> bool:
        times = arrivals.at(rate, len(workload))
        return meets_targets(simulate_once(setup, cost, workload, times, handoff=handoff), targets)

    return find_max_rate(meets, start=start)
