"""Scheduler behaviour: hand-computed traces and property tests, no torch."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import Arrival, make_scheduler, simulate


def orca_example():
    # Requests A, B, C need 100, 10 and 50 output tokens; D, E, F wait. One-token
    # prompts, so a request with m output tokens that starts at step s finishes at
    # step s + m - 1 (its first step computes the prompt and samples token 1).
    lengths = {"A": 100, "B": 10, "C": 50, "D": 60, "E": 60, "F": 20}
    return [Arrival(0, rid, [7], m) for rid, m in lengths.items()]


def test_orca_example_iteration_level():
    res = simulate(make_scheduler("iteration", 1000, 16, max_num_seqs=3, budget=64), orca_example())
    assert res.first_scheduled["A"] == res.first_scheduled["B"] == res.first_scheduled["C"] == 0
    assert res.finished["B"] == 9
    assert res.first_scheduled["D"] == 10  # the step after B finishes
    assert res.finished["C"] == 49
    assert res.first_scheduled["E"] == 50  # the step after C finishes
    assert res.finished["D"] == 69
    assert res.first_scheduled["F"] == 70  # the step after D finishes
    assert res.finished["A"] == 99
    assert res.finished["E"] == 109
    assert res.steps == 110


def test_orca_example_static():
    res = simulate(make_scheduler("static", 1000, 16, max_num_seqs=3, budget=64), orca_example())
    assert res.finished["B"] == 9 and res.finished["C"] == 49 and res.finished["A"] == 99
    # Nobody joins until the whole batch (A, B, C) is done.
    assert res.first_scheduled["D"] == res.first_scheduled["E"] == res.first_scheduled["F"] == 100
    assert res.finished["F"] == 119 and res.finished["D"] == res.finished["E"] == 159
    assert res.steps == 160


def test_outputs_same_for_both_policies():
    a = simulate(make_scheduler("iteration", 1000, 16, 3, 64), orca_example())
    b = simulate(make_scheduler("static", 1000, 16, 3, 64), orca_example())
    assert a.outputs == b.outputs
    assert {k: len(v) for k, v in a.outputs.items()} == {"A": 100, "B": 10, "C": 50,
                                                         "D": 60, "E": 60, "F": 20}


def test_chunked_prefill_shares_step_with_decodes():
    # A decodes while B's 40-token prompt is split into chunks within a budget of 16.
    sched = make_scheduler("iteration", 100, 4, max_num_seqs=8, budget=16)
    arrivals = [Arrival(0, "A", [1, 2], 30), Arrival(2, "B", list(range(40)), 5)]
    res = simulate(sched, arrivals)
    assert res.max_tokens_in_step <= 16
    # B's prompt takes ceil(40 / 15) = 3 steps next to A's decode (15 + 1 tokens each).
    assert res.first_scheduled["B"] == 2
    assert res.finished["B"] == 2 + 3 - 1 + 5 - 1


def test_preemption_recomputes_and_finishes():
    # Pool of 6 blocks x 4 tokens. Two requests of 2 + 10 tokens need 3 blocks each at
    # the end; three of them cannot all run, so the latest admitted one is preempted.
    arrivals = [Arrival(0, r, [1, 2], 10) for r in "ABC"]
    res = simulate(make_scheduler("iteration", 6, 4, 8, 64), arrivals)
    assert res.preemptions >= 1
    ref = simulate(make_scheduler("iteration", 1000, 4, 8, 64), arrivals)
    assert res.outputs == ref.outputs


request_st = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 40),  # prompt length
    st.integers(1, 30),  # output length
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    spare_blocks=st.integers(0, 20),
    kind=st.sampled_from(["iteration", "static", "priority"]),
    prefix_caching=st.booleans(),
    shared_prefix=st.integers(0, 24),
)
def test_random_workloads(reqs, block_size, budget, max_num_seqs, spare_blocks, kind,
                          prefix_caching, shared_prefix):
    # Prompts share their first `shared_prefix` tokens, so prefix caching has hits.
    arrivals = [Arrival(s, f"r{i}", ([5] * shared_prefix + [(i * 31 + j) % 97 for j in range(p)])[:max(p, 1)], m,
                        priority=i % 3)
                for i, (s, p, m) in enumerate(reqs)]
    reqs = [(a.step, len(a.prompt), a.max_tokens) for a in arrivals]
    # The smallest pool that still holds the longest request alone, plus some slack.
    longest = max(p + m for _, p, m in reqs)
    num_blocks = -(-longest // block_size) + spare_blocks
    policy = "priority" if kind == "priority" else "fcfs"
    sched = make_scheduler("static" if kind == "static" else "iteration", num_blocks, block_size,
                           max_num_seqs, budget, prefix_caching=prefix_caching, scheduling_policy=policy)
    res = simulate(sched, arrivals)
    assert res.max_tokens_in_step <= budget
    assert res.max_seqs_in_step <= max_num_seqs
    assert sched.kv.num_free_blocks == num_blocks  # every block back in the pool
    sched.kv.check_consistency()
    assert set(res.outputs) == {a.request_id for a in arrivals}  # every request finished
    assert all(len(res.outputs[a.request_id]) == a.max_tokens for a in arrivals)
    unlimited = simulate(make_scheduler("iteration", 10_000, block_size, 64, 10_000), arrivals)
    assert res.outputs == unlimited.outputs
