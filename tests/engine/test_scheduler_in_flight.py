"""Steps in flight (pipeline parallelism): the scheduler leaves out the requests of a step whose
tokens are not back, never preempts them, and tells the runner to forget one only after its step
returns. No torch: the fake runner of tests/sim.py checks every block table and KV slot."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import Arrival, FakeRunner, make_scheduler, simulate, stop_by_length
from travelator.engine.request import Request, RequestStatus
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_output import RunnerOutput, SchedulerOutput
from travelator.sampling_params import SamplingParams


class InFlightRun:
    """Up to ``depth`` steps in flight, as the pipelined engine keeps them: schedule and send off
    while fewer are out, then take the oldest one's tokens back."""

    def __init__(self, sched: SchedulerBase, depth: int) -> None:
        self.sched, self.depth = sched, depth
        sched.set_micro_batches(depth)
        self.runner = FakeRunner(sched.kv.block_size)
        self.flights: deque[tuple[SchedulerOutput, RunnerOutput]] = deque()
        self.most_in_flight = 0
        self.outputs: dict[str, list[int]] = {}
        preempt = sched._preempt

        def checked_preempt(victim: Request) -> None:
            assert not self._flying(victim.request_id), f"{victim.request_id} preempted in flight"
            preempt(victim)

        sched._preempt = checked_preempt

    def _flying(self, rid: str) -> bool:
        return any(rid in out.num_scheduled_tokens for out, _ in self.flights)

    def launch(self) -> bool:
        out = self.sched.schedule()
        if not out.num_scheduled_tokens:
            self.sched.return_freed(out.freed_request_ids)
            return False
        flying = [rid for rid in out.num_scheduled_tokens if self._flying(rid)]
        assert not flying, f"scheduled again while in flight: {flying}"
        self.sched.start_flight(out)
        self.flights.append((out, self.runner.execute(out)))
        self.most_in_flight = max(self.most_in_flight, len(self.flights))
        return True

    def land(self) -> None:
        out, result = self.flights.popleft()
        for req, toks in self.sched.update_from_output(out, result):
            stop_by_length(self.sched, req, toks)
            if req.status.finished:
                self.outputs[req.request_id] = list(req.output_token_ids)

    def run(self, arrivals: list[Arrival]) -> dict[str, list[int]]:
        pending = sorted(arrivals, key=lambda a: a.step)
        step = 0
        while pending or self.sched.has_unfinished() or self.flights:
            while pending and pending[0].step <= step:
                a = pending.pop(0)
                self.sched.add_request(Request(a.request_id, a.prompt, SamplingParams(
                    ignore_eos=True, max_tokens=a.max_tokens), a.max_tokens, priority=a.priority))
            while len(self.flights) < self.depth and self.launch():
                pass
            if self.flights:
                self.land()
            self.sched.kv.check_consistency()
            step += 1
            assert step < 20_000, "did not finish: a hang or a starved request"
        return self.outputs


request_st = st.tuples(st.integers(0, 20), st.integers(1, 30), st.integers(1, 20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=2, max_size=10), block_size=st.sampled_from([2, 4]),
       budget=st.integers(4, 48), spare_blocks=st.integers(0, 8), depth=st.sampled_from([2, 3]),
       kind=st.sampled_from(["iteration", "priority", "orca", "static"]))
def test_steps_in_flight_give_one_steps_outputs(reqs, block_size, budget, spare_blocks, depth, kind):
    """Tight pools (preemption) and small budgets (chunked prefill): the same tokens as one step
    at a time, every block back, no request in two steps in flight, no victim in flight."""
    arrivals = [Arrival(s, f"r{i}", [(i * 31 + j) % 97 for j in range(p)], m, priority=i % 3)
                for i, (s, p, m) in enumerate(reqs)]
    num_blocks = -(-max(p + m for _, p, m in reqs) // block_size) + spare_blocks

    def scheduler() -> SchedulerBase:
        return make_scheduler("iteration" if kind == "priority" else kind, num_blocks, block_size, 8, budget,
                              scheduling_policy="priority" if kind == "priority" else "fcfs")

    want = simulate(scheduler(), arrivals).outputs
    sched = scheduler()
    got = InFlightRun(sched, depth).run(arrivals)
    assert got == want
    assert sched.kv.num_free_blocks == num_blocks and sched.num_in_flight == 0


def test_each_step_in_flight_takes_its_share_of_the_requests():
    """Four requests, two steps in flight: two requests each, so both stages have work."""
    arrivals = [Arrival(0, f"r{i}", [1, 2, 3 + i], 6) for i in range(4)]
    run = InFlightRun(make_scheduler("iteration", 64, 4, 8, 64), depth=2)
    launched = []
    execute = run.runner.execute
    run.runner.execute = lambda out: launched.append(sorted(out.num_scheduled_tokens)) or execute(out)
    assert run.run(arrivals) == simulate(make_scheduler("iteration", 64, 4, 8, 64), arrivals).outputs
    assert run.most_in_flight == 2
    assert launched[:4] == [["r0", "r1"], ["r2", "r3"], ["r0", "r1"], ["r2", "r3"]]


def test_an_aborted_request_in_flight_is_forgotten_after_its_step():
    """Its blocks go back at once, but the runner still samples its rows: it hears of the
    abort in the first step after the one in flight returns."""
    sched = make_scheduler("iteration", 64, 4, 8, 64)
    run = InFlightRun(sched, depth=2)
    for rid in "ab":
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), 4))
    assert run.launch()  # a's step (b's comes next: a micro-batch each)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.block_ids("a") == []
    assert run.launch()
    assert list(run.flights[-1][0].num_scheduled_tokens) == ["b"]
    assert "a" not in run.flights[-1][0].freed_request_ids
    run.land()
    assert "a" not in run.outputs and "a" not in sched.requests
    out = sched.schedule()  # b is still in flight
    assert out.is_empty and out.freed_request_ids == ["a"]


def test_a_request_id_in_flight_is_not_reused():
    sched = make_scheduler("iteration", 64, 4, 8, 64)
    run = InFlightRun(sched, depth=2)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), 4))
    run.launch()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), 4))
