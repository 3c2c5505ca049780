"""The simulator against timings worked out by hand: a constant (or linear) step cost and a
few requests, where every token's simulated time follows from the scheduler's rules."""

from __future__ import annotations

import pytest

from travelator.bench.metrics import compute_metrics
from travelator.bench.workloads import RequestSpec, Workload
from travelator.config import CacheConfig, SchedulerConfig
from travelator.sim.cost_model import LinearCostModel, StepShape
from travelator.sim.simulator import SimSetup, Simulation


def workload(*lengths: tuple[int, int], first_token: int = 10) -> Workload:
    """Requests of (prompt, output) lengths whose prompts share no block."""
    reqs = [RequestSpec([first_token + i] * p, o) for i, (p, o) in enumerate(lengths)]
    return Workload("test", 0, reqs, {})


def simulate(wl: Workload, arrivals, *, cost=None, blocks: int = 64, **sched):
    setup = SimSetup(SchedulerConfig(**sched), CacheConfig(block_size=4), blocks)
    return Simulation(setup, cost or LinearCostModel.constant(0.010)).run(wl, arrivals)


def test_iteration_level_timings_by_hand():
    # A (8 prompt, 3 out) at 0; B (4, 2) at 0.015. Steps of 10 ms:
    # 0.01 A prefill -> A1; 0.02 A decode -> A2 (B not there at 0.01); 0.03 A + B prefill ->
    # A3 (done), B1; 0.04 B decode -> B2 (done).
    run = simulate(workload((8, 3), (4, 2)), [0.0, 0.015])
    a, b = run.results
    assert a.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert b.token_times == pytest.approx([0.03, 0.04])
    assert a.ttft == pytest.approx(0.01) and b.ttft == pytest.approx(0.015)
    assert a.e2e == pytest.approx(0.03) and b.e2e == pytest.approx(0.025)
    assert a.tpot == pytest.approx(0.01) and b.tpot == pytest.approx(0.01)
    assert run.duration_s == pytest.approx(0.04)
    m = compute_metrics(run.results, run.duration_s, {"ttft": 12.0})
    assert m["median_ttft_ms"] == pytest.approx(12.5)
    assert m["good_requests"] == 1  # A's 10 ms TTFT meets 12 ms, B's 15 ms does not
    assert [s.stats.num_requests for s in run.steps] == [1, 1, 2, 1]


def test_static_batching_makes_the_late_request_wait_for_the_batch():
    # Same requests: B arrives while A's batch runs, and starts only after A's last step.
    run = simulate(workload((8, 3), (4, 2)), [0.0, 0.015], batching="static")
    a, b = run.results
    assert a.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert b.token_times == pytest.approx([0.04, 0.05])
    assert b.ttft == pytest.approx(0.025)
    assert run.duration_s == pytest.approx(0.05)


def test_dynamic_batching_holds_a_lone_request_for_the_queue_delay():
    # One request, a batch of 4 never fills: it waits 100 ms on the simulated clock.
    run = simulate(workload((4, 2)), [0.0], batching="dynamic", max_num_seqs=4, max_queue_delay_ms=100)
    assert run.results[0].token_times == pytest.approx([0.11, 0.12])


class Recorder(LinearCostModel):
    def __init__(self, coefficients):
        super().__init__(coefficients)
        self.shapes: list[StepShape] = []

    def step_seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return super().step_seconds(shape)


def test_chunked_prefill_shapes_and_a_linear_cost():
    # A 20-token prompt under a budget of 8: chunks of 8, 8, 4 (causal pairs 36, 100, 74), then
    # one decode over 21 keys. Cost: 1 ms + 0.5 ms per prefill token.
    cost = Recorder({"intercept": 0.001, "prefill_tokens": 0.0005})
    run = simulate(workload((20, 2)), [0.0], cost=cost, max_num_batched_tokens=8)
    # Each step the first of its row count but the second chunk of 8; each knows the rows of
    # the ones before (StepHistory); the engine never idles.
    assert cost.shapes == [StepShape(8, 0, 0, 36, 1, True, ()), StepShape(8, 0, 0, 100, 1, False, (8,)),
                           StepShape(4, 0, 0, 74, 1, True, (8, 8)), StepShape(0, 1, 21, 0, 1, True, (4, 8, 8))]
    r = run.results[0]
    assert r.ttft == pytest.approx(0.005 + 0.005 + 0.003)
    assert r.e2e == pytest.approx(0.013 + 0.001)


def test_the_first_step_of_a_row_count_costs_once_per_process():
    # 1 ms a step, 10 ms more for the first of its row count: chunks of 8, 8, 4, then a decode
    # pay it at 8, 4 and 1 rows; a simulated process that has run those counts does not.
    cost = LinearCostModel({"intercept": 0.001, "new_shape": 0.010})
    fresh = simulate(workload((20, 2)), [0.0], cost=cost, max_num_batched_tokens=8)
    assert fresh.results[0].token_times == pytest.approx([0.011 + 0.001 + 0.011, 0.034])
    setup = SimSetup(SchedulerConfig(max_num_batched_tokens=8), CacheConfig(block_size=4), 64,
                     seen_rows=frozenset({1, 4, 8}))
    warm = Simulation(setup, cost).run(workload((20, 2)), [0.0])
    assert warm.results[0].token_times == pytest.approx([0.003, 0.004])


def test_prefix_cache_hits_spare_the_shared_blocks():
    # Two prompts of 12 tokens sharing the first 8 (two blocks of 4); the second, arriving after
    # the first finished its prompt, computes only its last 4 tokens.
    shared = [7] * 8
    wl = Workload("test", 0, [RequestSpec(shared + [1, 2, 3, 4], 2), RequestSpec(shared + [5, 6, 7, 8], 2)], {})
    cost = Recorder({"intercept": 0.01})
    simulate(wl, [0.0, 0.05], cost=cost)
    assert [s.prefill_tokens for s in cost.shapes if s.prefill_tokens] == [12, 4]


def test_a_small_pool_preempts_and_every_request_still_finishes():
    # 12 blocks of 4 tokens; four requests that grow to 16 tokens each cannot all stay.
    run = simulate(workload(*[(8, 8)] * 4), [0.0] * 4, blocks=12)
    assert all(r.success and r.output_len == 8 for r in run.results)
    assert run.step_summary()["preemptions"] > 0


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="more than the pool"):
        simulate(workload((60, 8)), [0.0], blocks=16)


def test_speculative_decoding_at_a_given_acceptance():
    # Four drafts a step, every one accepted: a 40-token output is the prompt's step (token 1)
    # and then 5 tokens a step: 8 more steps of 10 ms. None accepted: one token a step.
    wl = workload((16, 40))
    spec = dict(speculative_method="draft", draft_model="simulated", num_speculative_tokens=4,
                speculative_policy="fixed")
    runs = {}
    for acceptance in (1.0, 0.0):
        setup = SimSetup(SchedulerConfig(**spec), CacheConfig(block_size=4), 64, draft_acceptance=acceptance)
        runs[acceptance] = Simulation(setup, LinearCostModel.constant(0.010)).run(wl, [0.0])
    every, none = runs[1.0].results[0], runs[0.0].results[0]
    assert every.output_len == none.output_len == 40
    assert every.e2e == pytest.approx(0.09) and every.token_times[1:6] == pytest.approx([0.02] * 5)
    assert none.e2e == pytest.approx(0.40)
    assert runs[1.0].step_summary()["acceptance_rate"] == 1.0
