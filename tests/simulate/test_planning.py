"""The planning answer (--find-max-rate), trace files, and the batching modes' known ordering."""

from __future__ import annotations

import pytest

from travelator.bench.arrivals import arrival_times
from travelator.bench.workloads import orca_synthetic
from travelator.config import CacheConfig, SchedulerConfig
from travelator.sim.cost_model import LinearCostModel
from travelator.sim.find_rate import find_max_rate, meets_targets, parse_slo_targets
from travelator.sim.simulator import SimSetup
from travelator.sim.sweep import Arrivals, search_max_rate, simulate_once
from travelator.sim.trace import load_trace

# A CPU-like step: a fixed cost plus a little per token.
COST = LinearCostModel({"intercept": 0.02, "prefill_tokens": 2e-4, "decode_tokens": 1e-3})
WORKLOAD = orca_synthetic(150, vocab_size=1000, seed=3)


def setup(**sched) -> SimSetup:
    return SimSetup(SchedulerConfig(max_num_seqs=32, **sched), CacheConfig(), num_kv_blocks=2048)


def test_slo_targets_parse_to_metric_keys_in_milliseconds():
    assert parse_slo_targets("ttft_p99=2s,tpot_p99=100ms") == {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}
    assert parse_slo_targets("e2e_p50=1.5s") == {"median_e2el_ms": 1500.0}
    for bad in ("ttft=2s", "ttft_p99=2", "ttft_p95=2s", "speed_p99=1s", ""):
        with pytest.raises(ValueError):
            parse_slo_targets(bad)


def test_the_search_brackets_a_known_boundary():
    search = find_max_rate(lambda r: r <= 3.7, start=1.0, rel_tol=0.01)
    assert 3.7 / 1.01 <= search.max_rate <= 3.7 < search.first_failing <= 3.7 * 1.01
    low = find_max_rate(lambda r: r <= 0.05, start=1.0)
    assert low.max_rate <= 0.05 < low.first_failing
    assert find_max_rate(lambda r: False, start=1.0, min_rate=0.1).max_rate is None


def test_the_found_rate_meets_the_slo_and_a_little_more_does_not():
    targets = parse_slo_targets("ttft_p99=1s,tpot_p99=150ms")
    search = search_max_rate(setup(), COST, WORKLOAD, Arrivals(), targets)
    assert search.max_rate is not None and search.first_failing <= search.max_rate * 1.02

    def metrics(rate):
        return simulate_once(setup(), COST, WORKLOAD, arrival_times(len(WORKLOAD), rate))

    assert meets_targets(metrics(search.max_rate), targets)
    assert not meets_targets(metrics(search.first_failing), targets)


def test_the_max_rate_grows_with_a_looser_slo_and_a_faster_engine():
    def best(slo: str, cost=COST) -> float:
        return search_max_rate(setup(), cost, WORKLOAD, Arrivals(), parse_slo_targets(slo)).max_rate

    tight, loose = best("ttft_p99=500ms"), best("ttft_p99=2s")
    assert tight < loose
    faster = LinearCostModel({k: v / 2 for k, v in COST.coefficients.items()})
    assert best("ttft_p99=500ms", faster) > 1.5 * tight


def test_iteration_level_scheduling_beats_request_level_batching():
    # Orca's result in miniature: at the same offered load, static batching holds joiners
    # until the whole batch ends, so latency per token is higher and fewer seats are busy.
    times = arrival_times(len(WORKLOAD), 4.0, seed=0)
    static = simulate_once(setup(batching="static"), COST, WORKLOAD, times)
    orca = simulate_once(setup(batching="orca"), COST, WORKLOAD, times)
    chunked = simulate_once(setup(batching="iteration"), COST, WORKLOAD, times)
    assert chunked["median_norm_latency_s_per_token"] < 0.5 * static["median_norm_latency_s_per_token"]
    assert orca["median_ttft_ms"] < 0.5 * static["median_ttft_ms"]
    assert chunked["request_throughput"] >= static["request_throughput"]


def test_a_trace_with_shared_prefixes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens\n"
                    "0.5,40,3,sys-a,32\n0.0,48,2,sys-a,32\n1.0,20,1,,\n2.0,40,4,sys-b,16\n")
    wl, times = load_trace(path, vocab_size=1000)
    assert list(times) == [0.0, 0.5, 1.0, 2.0]  # sorted, from the first arrival
    a0, a1, plain, b = wl.requests
    assert (a0.prompt_len, a1.prompt_len, a0.output_len) == (48, 40, 2)
    assert a0.prompt_token_ids[:32] == a1.prompt_token_ids[:32]
    assert a0.prompt_token_ids[32:40] != a1.prompt_token_ids[32:40]
    assert b.prompt_token_ids[:16] != a0.prompt_token_ids[:16]
    run = simulate_once(setup(), COST, wl, times)
    assert run["completed"] == 4
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens,prefix_tokens\n0,10,2,4\n")
    with pytest.raises(ValueError, match="bad.csv:2: prefix_tokens without a prefix_id"):
        load_trace(bad, vocab_size=1000)
