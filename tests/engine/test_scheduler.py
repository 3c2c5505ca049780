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


def test_orca_example_dynamic():
    # All six are queued at step 0, so the first batch is full at once: dynamic batching
    # then does exactly what static batching does, whatever its delay.
    res = simulate(make_scheduler("dynamic", 1000, 16, 3, 64, queue_delay_steps=5), orca_example())
    assert res.first_scheduled["A"] == res.first_scheduled["B"] == res.first_scheduled["C"] == 0
    assert res.first_scheduled["D"] == res.first_scheduled["E"] == res.first_scheduled["F"] == 100
    assert res.steps == 160


def test_orca_example_whole_prompts():
    # One-token prompts: computing a prompt whole or in chunks is the same, so Orca's own
    # scheduler gives the iteration-level trace (D joins at step 10, the 11th).
    res = simulate(make_scheduler("orca", 1000, 16, 3, 64), orca_example())
    assert res.first_scheduled["D"] == 10 and res.first_scheduled["E"] == 50
    assert res.first_scheduled["F"] == 70 and res.steps == 110


def staggered_arrivals():
    # One-token prompts; A, B, C arrive at steps 0, 2 and 3, D at 4, E alone at 20.
    lengths = {"A": (0, 10), "B": (2, 4), "C": (3, 6), "D": (4, 2), "E": (20, 1)}
    return [Arrival(step, rid, [7], m) for rid, (step, m) in lengths.items()]


def test_dynamic_batching_waits_for_a_full_batch_or_the_delay():
    res = simulate(make_scheduler("dynamic", 1000, 16, 3, 64, queue_delay_steps=5), staggered_arrivals())
    # A waits: the batch fills when C arrives at step 3, before A's 5-step delay ends.
    assert res.first_scheduled["A"] == res.first_scheduled["B"] == res.first_scheduled["C"] == 3
    assert res.finished["B"] == 6 and res.finished["C"] == 8 and res.finished["A"] == 12
    # D (step 4) waits for the whole batch; by then its delay is long over.
    assert res.first_scheduled["D"] == 13 and res.finished["D"] == 14
    # E arrives to an idle engine and waits its full delay for company that never comes.
    assert res.first_scheduled["E"] == 25 and res.finished["E"] == 25


def test_static_batching_same_arrivals():
    res = simulate(make_scheduler("static", 1000, 16, 3, 64), staggered_arrivals())
    assert res.first_scheduled["A"] == 0 and res.finished["A"] == 9  # A alone
    assert res.first_scheduled["B"] == res.first_scheduled["C"] == res.first_scheduled["D"] == 10
    assert res.finished["D"] == 11 and res.finished["B"] == 13 and res.finished["C"] == 15
    assert res.first_scheduled["E"] == 20


def test_iteration_level_same_arrivals():
    res = simulate(make_scheduler("iteration", 1000, 16, 3, 64), staggered_arrivals())
    assert (res.first_scheduled["A"], res.first_scheduled["B"], res.first_scheduled["C"]) == (0, 2, 3)
    assert res.finished["B"] == 5
    assert res.first_scheduled["D"] == 6 and res.finished["D"] == 7  # B's seat, the next step
    assert res.finished["C"] == 8 and res.finished["A"] == 9 and res.first_scheduled["E"] == 20


def test_outputs_same_for_every_batching():
    ref = simulate(make_scheduler("iteration", 1000, 16, 3, 64), orca_example())
    for batching in ("static", "dynamic", "orca"):
        assert simulate(make_scheduler(batching, 1000, 16, 3, 64, queue_delay_steps=2),
                        orca_example()).outputs == ref.outputs
    assert {k: len(v) for k, v in ref.outputs.items()} == {"A": 100, "B": 10, "C": 50,
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


def test_whole_prompt_stalls_the_decodes_for_one_step():
    # The same arrivals as above under Orca's scheduler: B's 40-token prompt is computed in
    # one step, over the budget (it could never run otherwise), next to A's decode.
    res = simulate(make_scheduler("orca", 100, 4, max_num_seqs=8, budget=16),
                   [Arrival(0, "A", [1, 2], 30), Arrival(2, "B", list(range(40)), 5)])
    assert res.max_tokens_in_step == 41 and res.partial_chunks == 0
    assert res.first_scheduled["B"] == 2 and res.finished["B"] == 2 + 5 - 1


def test_whole_prompts_join_first_come_first_served_within_the_budget():
    # Budget 16: C's 10-token prompt does not fit next to B's 10 in one step and waits for
    # the next, though D's 2 would have fitted: D does not overtake C.
    arrivals = [Arrival(0, "B", list(range(10)), 3), Arrival(0, "C", list(range(10, 20)), 3),
                Arrival(0, "D", [1, 2], 3)]
    res = simulate(make_scheduler("orca", 100, 4, max_num_seqs=8, budget=16), arrivals)
    assert (res.first_scheduled["B"], res.first_scheduled["C"], res.first_scheduled["D"]) == (0, 1, 1)
    assert res.partial_chunks == 0 and res.max_tokens_in_step == 1 + 10 + 2


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
    kind=st.sampled_from(["iteration", "static", "priority", "dynamic", "orca"]),
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
    sched = make_scheduler("iteration" if kind == "priority" else kind, num_blocks, block_size,
                           max_num_seqs, budget, prefix_caching=prefix_caching, scheduling_policy=policy,
                           queue_delay_steps=3)
    res = simulate(sched, arrivals)
    if kind == "orca":  # whole prompts: a step's first may exceed the budget on its own
        assert res.partial_chunks == 0
        assert res.max_tokens_in_step <= max(budget, longest + max_num_seqs)
    else:
        assert res.max_tokens_in_step <= budget
    assert res.max_seqs_in_step <= max_num_seqs
    assert sched.kv.num_free_blocks == num_blocks  # every block back in the pool
    sched.kv.check_consistency()
    assert set(res.outputs) == {a.request_id for a in arrivals}  # every request finished
    assert all(len(res.outputs[a.request_id]) == a.max_tokens for a in arrivals)
    unlimited = simulate(make_scheduler("iteration", 10_000, block_size, 64, 10_000), arrivals)
    assert res.outputs == unlimited.outputs


def test_whole_prompts_count_prefix_cache_hits_against_the_budget():
    # A's 40-token prompt is cached when B (the same 40 tokens and 2 more) and C (2 tokens)
    # arrive; C first. B has only 2 tokens left to compute: it joins in C's step, within the
    # budget of 16, rather than waiting for a step of its own.
    prompt = list(range(40))
    arrivals = [Arrival(0, "A", prompt, 1), Arrival(3, "C", [1, 2], 2), Arrival(3, "B", prompt + [7, 8], 2)]
    res = simulate(make_scheduler("orca", 100, 4, max_num_seqs=8, budget=16, prefix_caching=True), arrivals)
    assert res.first_scheduled["C"] == res.first_scheduled["B"] == 3


def test_waiting_requests_holding_blocks_cannot_deadlock_the_pool():
    """Two handed-off requests (``LLMEngine.add_handoff``: blocks written, then queued) of 8
    prompt tokens fill a pool of 4 blocks of 4 tokens; each needs a fifth block for its next
    token, and nothing runs. The latest gives its blocks up and will recompute; the other decodes at once."""
    from travelator.engine.request import Request, RequestStatus
    from travelator.sampling_params import SamplingParams

    sched = make_scheduler("iteration", 4, 4, max_num_seqs=4, budget=64)
    handed = []
    for rid in ("A", "B"):
        req = Request(request_id=rid, prompt_token_ids=list(range(1, 9)), sampling_params=SamplingParams(),
                      max_tokens=4, eos_token_ids=frozenset())
        req.output_token_ids = [9]  # the first token, sampled by the prefill engine
        assert sched.kv.allocate_slots(req, 8) is not None  # the prompt's KV: 2 full blocks
        req.num_computed_tokens = 8
        sched.add_request(req)
        handed.append(req)
    assert sched.kv.num_free_blocks == 0
    out = sched.schedule()
    a, b = handed
    assert out.num_scheduled_tokens == {"A": 1} and out.num_preempted == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv.block_ids("B") == [] and len(sched.kv.block_ids("A")) == 3
    assert [r.request_id for r in sched.running] == ["A"] and [r.request_id for r in sched.waiting] == ["B"]
