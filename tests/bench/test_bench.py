"""Benchmark building blocks: arrivals, workloads, metrics, the ratio line, the CLI.

No timing is asserted anywhere: the figures are computed from hand-made timestamps.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from travelator.bench.arrivals import arrival_times, parse_rate
from travelator.bench.compare import ratio_line, throughput_at_latency
from travelator.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_metrics,
    meets_slo,
    parse_slo,
)
from travelator.bench.workloads import CONVERSATIONAL, make_workload


# ---- arrivals -------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_mean_gap_matches_rate(rate):
    t = arrival_times(40_001, rate, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness_keeps_the_mean_and_raises_the_spread():
    gaps = np.diff(arrival_times(40_001, 2.0, burstiness=0.25, seed=2))
    assert gaps.mean() == pytest.approx(0.5, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)


def test_arrivals_are_one_pattern_scaled_by_the_rate():
    slow = arrival_times(50, 1.0, seed=3)
    fast = arrival_times(50, 4.0, seed=3)
    np.testing.assert_allclose(slow, fast * 4)
    assert np.array_equal(arrival_times(5, math.inf), np.zeros(5))
    assert not np.array_equal(slow, arrival_times(50, 1.0, seed=4))


def test_bad_rates_are_refused():
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            arrival_times(3, bad)
    with pytest.raises(ValueError):
        parse_rate("fast")
    assert parse_rate("inf") == math.inf


# ---- workloads ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["orca", "conversational", "fixed"])
def test_workload_is_identical_from_the_same_seed(kind):
    a = make_workload(kind, 40, vocab_size=512, seed=7)
    b = make_workload(kind, 40, vocab_size=512, seed=7)
    c = make_workload(kind, 40, vocab_size=512, seed=8)
    assert a.requests == b.requests
    assert a.summary() == b.summary()
    assert a.requests != c.requests


def test_orca_lengths_are_in_their_ranges():
    w = make_workload("orca", 500, vocab_size=100, seed=0, prompt_len_range=(5, 9),
                      output_len_range=(1, 3))
    assert {r.prompt_len for r in w.requests} == set(range(5, 10))
    assert {r.output_len for r in w.requests} == {1, 2, 3}
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert min(ids) >= 3 and max(ids) < 100


def test_conversational_is_heavy_tailed_near_its_targets():
    w = make_workload("conversational", 5_000, vocab_size=32000, seed=0)
    p = np.array([r.prompt_len for r in w.requests])
    o = np.array([r.output_len for r in w.requests])
    assert p.mean() == pytest.approx(CONVERSATIONAL["prompt"].mean, rel=0.06)
    assert o.mean() == pytest.approx(CONVERSATIONAL["output"].mean, rel=0.06)
    assert np.median(p) < 0.7 * p.mean()  # right-skewed
    assert p.max() > 8 * np.median(p)  # a long tail


def test_salted_replays_differ_only_in_the_first_token():
    w = make_workload("orca", 20, vocab_size=50, seed=1)
    firsts = {tuple(r.prompt_token_ids[0] for r in w.salted(k).requests) for k in range(5)}
    assert len(firsts) == 5  # every salt gives every request a different first token
    for a, b in zip(w.requests, w.salted(3).requests):
        assert a.prompt_token_ids[1:] == b.prompt_token_ids[1:] and a.output_len == b.output_len
        assert 3 <= b.prompt_token_ids[0] < 50
    assert w.salted(0) is w


def test_workload_fits_the_context():
    w = make_workload("fixed", 3, vocab_size=64, prompt_len=100, output_len=100, max_model_len=64)
    assert all(r.prompt_len + r.output_len <= 64 and r.output_len >= 1 for r in w.requests)
    with pytest.raises(ValueError):
        make_workload("orca", 3, vocab_size=64, prompt_len_range=(10, 5))
    with pytest.raises(ValueError):
        make_workload("nope", 3, vocab_size=64)


# ---- metrics --------------------------------------------------------------------------
def _hand_example() -> list[RequestResult]:
    a = RequestResult(prompt_len=10, expected_output_len=3, arrival=0.0,
                      token_times=[0.5, 0.7, 1.0], end=1.0, output_len=3, success=True)
    b = RequestResult(prompt_len=20, expected_output_len=1, arrival=1.0,
                      token_times=[1.1], end=1.1, output_len=1, success=True)
    c = RequestResult(prompt_len=5, expected_output_len=4, arrival=0.2, error="HTTP 500")
    return [a, b, c]


def test_metrics_against_a_hand_computed_example():
    m = compute_metrics(_hand_example(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.0)  # 4 tokens / 2 s
    assert m["total_token_throughput"] == pytest.approx(17.0)  # (30 + 4) / 2 s
    # TTFT: 500 and 100 ms.
    assert m["mean_ttft_ms"] == pytest.approx(300)
    assert m["median_ttft_ms"] == pytest.approx(300)
    assert m["p90_ttft_ms"] == pytest.approx(460)  # 100 + 0.9 * 400
    assert m["p99_ttft_ms"] == pytest.approx(496)
    # TPOT: only A has two or more tokens: (1.0 - 0.5) / 2.
    assert m["mean_tpot_ms"] == pytest.approx(250)
    assert m["p99_tpot_ms"] == pytest.approx(250)
    # ITL: A's gaps 200 and 300 ms.
    assert m["mean_itl_ms"] == pytest.approx(250)
    assert m["p90_itl_ms"] == pytest.approx(290)
    # E2E: 1000 and 100 ms.
    assert m["median_e2el_ms"] == pytest.approx(550)
    assert m["p90_e2el_ms"] == pytest.approx(910)
    # Orca's normalised latency: 1.0 / 3 and 0.1 / 1.
    assert m["median_norm_latency_s_per_token"] == pytest.approx((1 / 3 + 0.1) / 2)
    assert "goodput" not in m
    text = format_metrics(m)
    assert "Successful requests:" in text and "Median TTFT (ms):" in text


@pytest.mark.parametrize("slo,good", [
    (["ttft:400"], 1),  # A's first token took 500 ms
    (["ttft:600", "e2el:1000"], 2),
    (["tpot:200"], 1),  # A's TPOT is 250 ms; B has none, so it passes
    (["itl:250"], 1),  # A has a 300 ms gap
    (["e2e:99"], 0),
])
def test_goodput(slo, good):
    parsed = parse_slo(slo)
    m = compute_metrics(_hand_example(), duration_s=2.0, slo=parsed)
    assert m["good_requests"] == good
    assert m["goodput"] == pytest.approx(good / 2.0)
    assert not meets_slo(_hand_example()[2], parsed)  # failed requests never count


def test_parse_slo():
    assert parse_slo(["ttft:500", "TPOT=50", "e2e:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["ttft"], ["speed:3"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_empty_run_has_no_percentiles():
    m = compute_metrics([], duration_s=1.0)
    assert m["completed"] == 0 and m["median_ttft_ms"] is None


# ---- the ratio line ---------------------------------------------------------------------
def test_throughput_at_latency_interpolates_the_crossing():
    pts = [(1.0, 0.1), (2.0, 0.2), (3.0, 0.6)]
    r = throughput_at_latency(pts, 0.4)
    assert r.value == pytest.approx(2.5) and not r.lower_bound
    r = throughput_at_latency(pts, 1.0)
    assert r.value == pytest.approx(3.0) and r.lower_bound
    assert throughput_at_latency(pts, 0.05).value is None


def test_ratio_line():
    rows = [
        {"scheduler": "static", "rate": 1, "request_throughput": 1.0, "median_norm_latency_s_per_token": 0.1},
        {"scheduler": "static", "rate": 2, "request_throughput": 1.2, "median_norm_latency_s_per_token": 0.5},
        {"scheduler": "iteration", "rate": 1, "request_throughput": 1.0, "median_norm_latency_s_per_token": 0.05},
        {"scheduler": "iteration", "rate": 2, "request_throughput": 2.0, "median_norm_latency_s_per_token": 0.1},
        {"scheduler": "iteration", "rate": 4, "request_throughput": 3.0, "median_norm_latency_s_per_token": 0.4},
    ]
    line, info = ratio_line(rows, target=0.2)
    # static: between (1.0, 0.1) and (1.2, 0.5): 1.0 + 0.2 * 0.25 = 1.05
    # iteration: between (2.0, 0.1) and (3.0, 0.4): 2.0 + 1.0 / 3
    assert info["static_req_per_s"] == pytest.approx(1.05)
    assert info["iteration_req_per_s"] == pytest.approx(2 + 1 / 3)
    assert info["ratio"] == pytest.approx((2 + 1 / 3) / 1.05)
    assert line.startswith("Throughput ratio") and "2.22x" in line


# ---- the CLI ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from travelator.bench.cli import add_bench_parser

    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_bench_parser_has_three_subcommands():
    from travelator.bench import commands

    p = _parser()
    a = p.parse_args(["bench", "compare", "--request-rates", "1", "inf", "--model", "dummy:tiny"])
    assert a.func is commands.cmd_compare and a.request_rates == ["1", "inf"]
    a = p.parse_args(["bench", "throughput", "--workload", "fixed", "--goodput", "ttft:100"])
    assert a.func is commands.cmd_throughput and a.goodput == ["ttft:100"]
    a = p.parse_args(["bench", "serve", "--base-url", "http://x:1", "--max-concurrency", "4"])
    assert a.func is commands.cmd_serve and a.max_concurrency == 4


def test_server_gets_the_engine_options_that_were_given():
    from travelator.engine_args import engine_argv

    a = _parser().parse_args(["bench", "serve", "--model", "dummy:tiny", "--dtype", "bfloat16",
                              "--max-num-seqs", "8"])
    assert engine_argv(a) == ["--model", "dummy:tiny", "--dtype", "bfloat16", "--max-num-seqs", "8"]
    a = _parser().parse_args(["bench", "serve", "--no-prefix-caching"])
    assert engine_argv(a) == ["--no-prefix-caching"]


def test_wires_into_the_main_cli():
    """`travelator bench ...` reaches the bench commands through the main parser."""
    from travelator import cli as main_cli
    from travelator.bench import commands

    parser = main_cli.build_parser()
    a = parser.parse_args(["bench", "throughput", "--model", "dummy:tiny", "--num-requests", "3"])
    assert a.func is commands.cmd_throughput and a.num_requests == 3


# ---- the interference metrics ------------------------------------------------------------
def test_interference_metrics_by_hand():
    from travelator.bench.interference import interference_metrics
    from travelator.bench.runner import RunResult

    def done(arrival, times):
        return RequestResult(4, len(times), arrival, token_times=times, end=times[-1],
                             output_len=len(times), success=True)

    # Two steady decodes: gaps of 10 ms, and one stall of 500 ms in the first.
    d1 = done(0.0, [0.01, 0.02, 0.52, 0.53])
    d2 = done(0.0, [0.01, 0.02, 0.03])
    # Two long prompts: first tokens 0.4 s and 0.1 s after they arrived.
    l1, l2 = done(0.1, [0.5, 0.51]), done(0.5, [0.6])
    m = interference_metrics(RunResult([d1, d2, l1, l2], duration_s=1.0), num_decodes=2)
    gaps = [10, 500, 10, 10, 10]  # ms, pooled over the decodes only
    assert m["tbt_p50_ms"] == pytest.approx(10.0)
    assert m["tbt_p99_ms"] == pytest.approx(np.percentile(gaps, 99))
    assert m["tbt_max_ms"] == pytest.approx(500.0)
    assert m["long_ttft_median_ms"] == pytest.approx(250.0) and m["long_ttft_max_ms"] == pytest.approx(400.0)
    assert m["output_throughput"] == pytest.approx(10.0) and m["failed"] == 0
