"""Prefill/decode disaggregation (DistServe) simulated as two pools of devices.

Each pool is a ``Simulation`` of its own (its scheduler, KV pool and cost model) and steps
when it is free: the prefill pool computes each prompt and its first token, as the engine's
hand-off does (``max_tokens`` 1, then the KV leaves); the KV then takes ``handoff_seconds``
to reach the decode pool, which places it as the engine's ``add_handoff`` does (blocks for
every token but the one sampled, waiting while its pool has no room) and decodes the rest.
The two pools run at the same time on one simulated clock, each moving as the engine's step
loop does (``Simulation.act``: with pipeline stages, a step per stage in flight); a step's
tokens appear when it lands.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from travelator.bench.metrics import RequestResult
from travelator.bench.runner import RunResult, StepRecord, sampling_params_for
from travelator.bench.workloads import Workload
from travelator.engine.request import Request, RequestStatus, Stop
from travelator.sim.pipeline import Flight
from travelator.sim.simulator import SAMPLED_TOKEN_ID, Simulation


# Seconds for the KV of so many tokens to reach the decode pool.
HandoffTime = Callable[[int], float]


class DisaggregatedSimulation:
    def __init__(self, prefill: Simulation, decode: Simulation,
                 handoff_seconds: HandoffTime) -> None:
        """``handoff_seconds(num_tokens)``: how long the KV of that many tokens takes to move."""
        self.prefill, self.decode = prefill, decode
        self.handoff_seconds = handoff_seconds

    def run(self, workload: Workload, arrivals) -> RunResult:
        arrivals = np.asarray(arrivals, dtype=float)
        n = len(workload)
        self._workload = workload
        self._results = [RequestResult(r.prompt_len, r.output_len, float(a))
                         for r, a in zip(workload.requests, arrivals)]
        self._handoffs: list[tuple[float, int]] = []  # (when the KV arrives, request index)
        self._steps: list[StepRecord] = []
        self._done = 0
        now, nxt = 0.0, 0
        while self._done < n:
            while nxt < n and arrivals[nxt] <= now:
                spec = workload.requests[nxt]
                self.prefill.scheduler.add_request(
                    Request(f"sim-{nxt}", list(spec.prompt_token_ids), sampling_params_for(1), max_tokens=1))
                nxt += 1
            for pool in (self.prefill, self.decode):
                self._drive(pool, now)
            if self._done == n:
                break
            # What can change next: an arrival, a hand-off's KV arriving, a pool's next move.
            candidates = [arrivals[nxt] if nxt < n else None, self._handoffs[0][0] if self._handoffs else None,
                          self.prefill.due, self.decode.due]
            events = [t for t in candidates if t is not None and t > now]
            if not events:
                raise RuntimeError(f"the pools schedule nothing, {n - self._done} requests unfinished")
            now = min(events)
        end = max(r.end for r in self._results)
        return RunResult(self._results, end, sorted(self._steps, key=lambda s: s.t),
                         self.decode.setup.scheduler.max_num_seqs)

    def _drive(self, pool: Simulation, now: float) -> None:
        """Every move the pool's engine makes at ``now`` (``Simulation.act``), the hand-offs
        whose KV has arrived joining the decode pool before each (a landing step may have freed
        the blocks they wait for)."""
        pool.clock.now = now
        while pool.due is None or pool.due <= now:
            self._place_handoffs(now)
            flight = pool.act()
            if flight is not None:
                self._landed(pool, flight)
            elif pool.due is None:
                return

    def _landed(self, pool: Simulation, flight: Flight) -> None:
        """A step's tokens are back: a prompt done in the prefill pool sends its KV off, a
        request done in the decode pool (or one whose output is one token) ends."""
        end = flight.end
        for req, toks in pool.scheduler.update_from_output(flight.out, flight.sampled):
            i = int(req.request_id.removeprefix("sim-"))
            r = self._results[i]
            # Tokens past max_tokens (accepted drafts) are dropped, as find_stop drops them.
            extra = max(len(req.output_token_ids) - req.max_tokens, 0)
            r.token_times.extend([end] * (len(toks) - extra))
            if len(req.output_token_ids) < req.max_tokens:
                continue
            pool.scheduler.stop_request(req, extra, Stop(RequestStatus.FINISHED_LENGTH))
            if pool is self.prefill and r.expected_output_len > 1:
                heapq.heappush(self._handoffs, (end + self.handoff_seconds(req.num_prompt_tokens), i))
            else:
                r.end, r.output_len, r.success = end, len(r.token_times), True
                self._done += 1
        self._steps.append(StepRecord(end, pool.step_stats(flight.out, flight.sampled, flight.seconds)))

    def _place_handoffs(self, now: float) -> None:
        """Requests whose KV has arrived join the decode pool, first come first served; one
        that finds no room waits (with those behind it) for the pool's next step."""
        sim = self.decode
        while self._handoffs and self._handoffs[0][0] <= now:
            i = self._handoffs[0][1]
            spec = self._workload.requests[i]
            req = Request(f"sim-{i}", list(spec.prompt_token_ids), sampling_params_for(spec.output_len),
                          max_tokens=spec.output_len)
            req.output_token_ids = [SAMPLED_TOKEN_ID]
            if sim.kv.allocate_slots(req, spec.prompt_len) is None:
                return
            req.num_computed_tokens = spec.prompt_len
            sim.scheduler.add_request(req)
            heapq.heappop(self._handoffs)
