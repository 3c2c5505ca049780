"""Prefix caching and priority scheduling: the block pool's hash chain, hand-computed
priority traces, and outputs identical with caching on and off."""

from __future__ import annotations

import pytest

from sim import Arrival, make_scheduler, simulate
from travelator.engine.block_manager import KVCacheManager
from travelator.engine.request import Request
from travelator.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4, cache_salt=salt)


def run_prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """Admit r with its cached prefix and mark its whole prompt computed."""
    hit = kv.find_cached_prefix(r)
    blocks = kv.allocate_slots(r, r.num_tokens, hit)
    assert blocks is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return kv.block_ids(r.request_id)


def test_equal_tokens_after_different_prefixes_never_share():
    kv = KVCacheManager(16, 4)
    a = run_prefill(kv, req("a", [1, 2, 3, 4, 9, 9, 9, 9, 7]))
    b = req("b", [5, 6, 7, 8, 9, 9, 9, 9, 7])  # block 2 equal, block 1 differs
    assert kv.find_cached_prefix(b) == []
    c = req("c", [1, 2, 3, 4, 9, 9, 9, 9, 8])
    assert kv.find_cached_prefix(c) == a[:2]  # both full blocks shared, last partial not
    kv.check_consistency()


def test_salt_and_namespace_separate_entries():
    kv = KVCacheManager(16, 4)
    run_prefill(kv, req("a", [1, 2, 3, 4, 5], salt="alice"))
    assert kv.find_cached_prefix(req("b", [1, 2, 3, 4, 5], salt="bob")) == []
    assert len(kv.find_cached_prefix(req("c", [1, 2, 3, 4, 5], salt="alice"))) == 1
    other = KVCacheManager(16, 4, namespace="another model")
    k1 = kv.block_keys(req("x", [1, 2, 3, 4]))
    k2 = other.block_keys(req("x", [1, 2, 3, 4]))
    assert k1 != k2


def test_at_least_one_token_is_computed():
    kv = KVCacheManager(16, 4)
    run_prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    kv.free("a")
    # The same 8 tokens again: both blocks are cached, but only the first is reused.
    assert len(kv.find_cached_prefix(req("b", [1, 2, 3, 4, 5, 6, 7, 8]))) == 1


def test_freed_blocks_stay_reusable_until_evicted_lru():
    kv = KVCacheManager(4, 2)
    a = run_prefill(kv, req("a", [1, 2, 3, 4, 5]))  # 3 blocks, 2 full and keyed
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    # A hit takes the blocks back out of the free list.
    b = req("b", [1, 2, 3, 4, 6])
    hit = kv.find_cached_prefix(b)
    assert hit == a[:2]
    kv.allocate_slots(b, 5, hit)
    assert kv.block_ids("b")[:2] == a[:2]
    kv.free("b")
    # New data that needs every block evicts the cached ones: their keys are gone.
    c = req("c", [9, 9, 9, 9, 9, 9, 9, 9])
    assert kv.find_cached_prefix(c) == []
    kv.allocate_slots(c, 8)
    assert kv.num_cached_blocks == 0
    assert kv.find_cached_prefix(req("d", [1, 2, 3, 4, 5])) == []  # a reused block's key is gone
    kv.check_consistency()


def test_eviction_order_tail_first():
    kv = KVCacheManager(4, 2)
    run_prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9][:8]))  # 4 full blocks
    kv.free("a")
    # Need one block: the tail block (tokens 7, 8) is evicted, the head stays cached.
    kv.allocate_slots(req("z", [0]), 1)
    assert len(kv.find_cached_prefix(req("b", [1, 2, 3, 4, 5, 6, 0]))) == 3


def test_priority_hand_computed_trace():
    # One seat. A (priority 1) runs; B (priority 0) and C (priority 1) wait. When A
    # finishes, B goes first although C arrived... after A but before B.
    sched = make_scheduler("iteration", 100, 4, max_num_seqs=1, budget=64, scheduling_policy="priority")
    arrivals = [Arrival(0, "A", [1], 3, priority=1), Arrival(1, "C", [1], 2, priority=1),
                Arrival(1, "B", [1], 2, priority=0)]
    res = simulate(sched, arrivals)
    assert res.first_scheduled == {"A": 0, "B": 3, "C": 5}
    fcfs = simulate(make_scheduler("iteration", 100, 4, 1, 64), arrivals)
    assert fcfs.first_scheduled == {"A": 0, "C": 3, "B": 5}


def test_priority_preempts_lowest_priority_latest():
    # 4 blocks of 4 tokens. Three requests each grow to 6 tokens (2 blocks); the pool
    # cannot hold all three. "hi" arrives last, so FCFS would preempt it; by priority
    # the victim is the latest priority-1 request, "lo2", and "hi" never is.
    arrivals = [Arrival(0, "lo1", [1, 2, 3], 3, priority=1), Arrival(0, "lo2", [1, 2, 5], 3, priority=1),
                Arrival(0, "hi", [1, 2, 4], 3, priority=0)]
    by_priority = simulate(make_scheduler("iteration", 4, 4, 8, 64, scheduling_policy="priority"), arrivals)
    assert by_priority.preempted and set(by_priority.preempted) == {"lo2"}
    assert by_priority.finished["hi"] == 2
    fcfs = simulate(make_scheduler("iteration", 4, 4, 8, 64), arrivals)
    assert fcfs.preempted[0] == "hi"


def test_big_waiting_request_is_overtaken_a_bounded_number_of_times():
    # "big" cannot fit while "long" runs; small requests behind it may pass it, but
    # only max_overtakes (16) times, then they wait for it.
    # Pool: 20 blocks of 4. "long" holds 8 to 17 of them while it runs; "big" needs 15
    # at once (its 60-token prompt fits the budget in one chunk), so it waits for "long".
    sched = make_scheduler("iteration", 20, 4, max_num_seqs=8, budget=64)
    arrivals = [Arrival(0, "long", [1] * 28, 40), Arrival(1, "big", [2] * 60, 2)]
    arrivals += [Arrival(2 + i, f"s{i}", [3, i], 1) for i in range(30)]
    res = simulate(sched, arrivals)
    passed = [a.request_id for a in arrivals[2:] if res.first_scheduled[a.request_id] < res.first_scheduled["big"]]
    assert len(passed) == 16
    assert res.first_scheduled["big"] == res.finished["long"] + 1


# ---- end to end, on a real model ------------------------------------------------------
from hf_models import (build_checkpoint, gemma3_overrides, load_reference, phi3_overrides,  # noqa: E402
                       reference_greedy)
from travelator import LLM  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen3", "phi3", "gemma3"])
def checkpoint(tmp_path_factory, request):
    overrides = {"phi3": phi3_overrides(original=512, maximum=512),
                 "gemma3": gemma3_overrides(window=5)}.get(request.param, {})
    path = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **overrides)
    return path, load_reference(path)


def greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


def test_outputs_identical_with_and_without_prefix_caching(checkpoint):
    path, ref = checkpoint
    system = [1] + list(range(10, 50))  # 41 tokens: two full blocks of 16 and a partial
    turn1 = system + [60, 61, 62, 63, 64, 65, 66]
    prompts = [
        system + [70, 71, 72],  # shared system prompt
        system + [80, 81],
        turn1,
        turn1 + [90, 91, 92, 93, 94, 95, 96, 97, 98],  # a multi-turn chat: turn 2 extends turn 1
        list(range(100, 132)),  # exactly two blocks
        list(range(100, 132)),  # the same again: all cached but the last token
        list(range(100, 131)) + [5],  # shares all but its last token
        list(range(100, 148)),  # ends on a block boundary, extends the one above
    ]
    on = LLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=64)
    off = LLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    got_on, got_off = [], []
    for p in prompts:  # one at a time, so later prompts find earlier blocks cached
        got_on.append(on.generate([p], greedy(12), use_tqdm=False)[0].token_ids)
        got_off.append(off.generate([p], greedy(12), use_tqdm=False)[0].token_ids)
    assert got_on == got_off
    for p, out in zip(prompts, got_on):
        assert out == reference_greedy(ref, p, 12)
    assert on.engine.kv.stats.hit_tokens > 0 and off.engine.kv.stats.hit_tokens == 0
    assert on.engine.counters.computed_prompt_tokens < off.engine.counters.computed_prompt_tokens
    on.engine.kv.check_consistency()


def test_shared_512_token_prefix_computes_80_percent_fewer_prompt_tokens():
    prefix = [1] + [(7 * i) % 1000 + 3 for i in range(511)]
    prompts = [prefix + [5 + i, 6 + i, 7 + i] for i in range(64)]

    def computed(caching: bool) -> tuple[int, list]:
        llm = LLM("dummy:tiny", dtype="float32", enable_prefix_caching=caching,
                  max_num_batched_tokens=1024, max_num_seqs=64)
        res = llm.generate(prompts, greedy(2), use_tqdm=False)
        return llm.engine.counters.computed_prompt_tokens, [r.token_ids for r in res]

    with_cache, out_on = computed(True)
    without, out_off = computed(False)
    assert out_on == out_off
    assert without == 64 * 515
    assert with_cache <= 0.2 * without, (with_cache, without)
