"""Prefill and decode in two simulated pools, against timings worked out by hand."""

from __future__ import annotations

import pytest

from test_simulator import workload

from travelator.config import CacheConfig, SchedulerConfig
from travelator.sim.cost_model import LinearCostModel
from travelator.sim.disagg import DisaggregatedSimulation
from travelator.sim.simulator import SimSetup, Simulation


def pools(decode_blocks: int = 64) -> DisaggregatedSimulation:
    def pool(blocks: int) -> Simulation:
        return Simulation(SimSetup(SchedulerConfig(), CacheConfig(block_size=4), blocks),
                          LinearCostModel.constant(0.010))

    return DisaggregatedSimulation(pool(64), pool(decode_blocks), handoff_seconds=lambda tokens: 0.005)


def test_the_pools_overlap_and_the_kv_takes_its_time():
    # Steps of 10 ms, hand-offs of 5 ms. A (8 prompt, 3 out) at 0, B (8, 3) at 0.012.
    # Prefill pool: A 0-0.01 (A1), B 0.012-0.022 (B1). Decode pool: A's KV at 0.015, A2 at 0.025;
    # B's KV arrives at 0.027 while the pool runs A's last step (A3 at 0.035); B2 0.045, B3 0.055.
    run = pools().run(workload((8, 3), (8, 3)), [0.0, 0.012])
    a, b = run.results
    assert a.token_times == pytest.approx([0.01, 0.025, 0.035])
    assert b.token_times == pytest.approx([0.022, 0.045, 0.055])
    assert a.success and b.success and (a.output_len, b.output_len) == (3, 3)
    assert run.duration_s == pytest.approx(0.055)


def test_one_token_outputs_never_reach_the_decode_pool_and_a_full_pool_makes_kv_wait():
    run = pools().run(workload((8, 1)), [0.0])
    assert run.results[0].token_times == pytest.approx([0.01]) and len(run.steps) == 1
    # The decode pool holds 3 blocks of 4: one request of 8 + 3 tokens at a time, so the second
    # hand-off (ready at 0.015 too) waits until the first request has finished (at 0.035).
    run = pools(decode_blocks=3).run(workload((8, 3), (8, 3)), [0.0, 0.0])
    a, b = run.results
    assert a.token_times == pytest.approx([0.01, 0.025, 0.035])
    assert b.token_times == pytest.approx([0.01, 0.045, 0.055])
