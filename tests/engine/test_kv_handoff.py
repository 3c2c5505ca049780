"""Prefill on one engine, decode on another (the KV hand-off of disaggregation): the text
is the single engine's, token for token, and neither pool leaks a block."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paths import STORIES, STORIES_EXPECTED, needs_stories

from travelator import LLM, SamplingParams
from travelator.engine.kv_handoff import OLD_KV_LAYOUT, KVPoolFullError

pytestmark = needs_stories

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]
# Bitwise the same numbers whatever the batch: the comparison is exact by construction.
ENGINE = dict(device="cpu", dtype="float32", batch_invariant=True, block_size=8)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run(engine, until=None):
    """Step until idle; every output by request id (the last one of each)."""
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def prefill_then_decode(prefill, decode, prompts, params):
    ids = [prefill.add_request(p, params, hand_off=True).request_id for p in prompts]
    first = run(prefill)
    handoffs = {rid: first[rid][-1].handoff for rid in ids}
    for rid in ids:
        decode.add_handoff(handoffs[rid], params)
    rest = run(decode)
    texts = [first[rid][-1].text + "".join(o.new_text for o in rest[rid]) for rid in ids]
    tokens = [handoffs[rid].output_token_ids + rest[rid][-1].output_token_ids[1:] for rid in ids]
    return texts, tokens, handoffs, rest


def test_two_engines_give_the_single_engines_text():
    params = greedy(40)
    ref = LLM(str(STORIES), **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    prefill, decode = LLM(str(STORIES), **ENGINE).engine, LLM(str(STORIES), **ENGINE).engine
    texts, tokens, handoffs, rest = prefill_then_decode(prefill, decode, PROMPTS, params)
    assert tokens == [r.outputs[0].token_ids for r in ref]
    assert texts == [r.outputs[0].text for r in ref]
    assert PROMPTS[0] + texts[0] == STORIES_EXPECTED[: len(PROMPTS[0] + texts[0])]
    # The prefill engine computed every prompt, the decode engine none.
    assert prefill.counters.computed_prompt_tokens == sum(len(h.prompt_token_ids) for h in handoffs.values())
    assert decode.counters.computed_prompt_tokens == 0
    assert all(outs[-1].finish_reason == "length" for outs in rest.values())
    for engine in (prefill, decode):
        assert engine.kv.num_used_blocks == 0
        engine.kv.check_consistency()
        assert engine.runner.held_request_ids() <= set(engine.scheduler.pending_freed_ids)


def test_an_int8_cache_hands_off_its_rows_as_they_are():
    """Codes and scales travel together: the pair of int8-cache engines writes the single
    int8-cache engine's text."""
    int8 = dict(ENGINE, kv_cache_dtype="int8")
    params = greedy(24)
    ref = LLM(str(STORIES), **int8).generate(PROMPTS, params, use_tqdm=False)
    prefill, decode = LLM(str(STORIES), **int8).engine, LLM(str(STORIES), **int8).engine
    _, tokens, _, _ = prefill_then_decode(prefill, decode, PROMPTS, params)
    assert tokens == [r.outputs[0].token_ids for r in ref]
    assert decode.runner.kv_caches[0][0].dtype == torch.int8


def test_the_prefill_engine_keeps_the_prompt_as_prefix_cache():
    prefill, decode = LLM(str(STORIES), **ENGINE).engine, LLM(str(STORIES), **ENGINE).engine
    prompt = "Lily and Tom went to the park and they played with a ball all day long"
    prefill_then_decode(prefill, decode, [prompt], greedy(4))
    prefill.add_request(prompt, greedy(4), hand_off=True)
    run(prefill)
    assert prefill.kv.stats.hit_tokens >= 8  # at least one full block came from the cache


def test_no_hand_off_when_the_request_ends_at_its_first_token():
    prefill = LLM(str(STORIES), **ENGINE).engine
    rid = prefill.add_request("One day", greedy(1), hand_off=True).request_id
    out = run(prefill)[rid][-1]
    assert out.finished and out.finish_reason == "length" and out.handoff is None
    assert prefill.kv.num_used_blocks == 0


def test_a_full_decode_pool_refuses_and_changes_nothing_then_takes_it():
    params = greedy(30)
    prefill = LLM(str(STORIES), **ENGINE).engine
    # 5 blocks of 8: room for one request of a few prompt tokens and 30 outputs.
    decode = LLM(str(STORIES), device="cpu", dtype="float32", batch_invariant=True, block_size=8, num_kv_blocks=5).engine
    ids = [prefill.add_request(p, params, hand_off=True).request_id for p in PROMPTS[:2]]
    first = run(prefill)
    decode.add_handoff(first[ids[0]][-1].handoff, params)
    need = len(first[ids[1]][-1].handoff.kv[0, 0])
    while decode.has_unfinished_requests() and decode.kv.num_free_blocks >= need:
        decode.step()  # the first grows until the second no longer fits
    free = decode.kv.num_free_blocks
    assert free < need and decode.has_unfinished_requests()
    with pytest.raises(KVPoolFullError):
        decode.add_handoff(first[ids[1]][-1].handoff, params)
    assert decode.kv.num_free_blocks == free and ids[1] not in decode.scheduler.requests
    run(decode)
    decode.add_handoff(first[ids[1]][-1].handoff, params)
    out = run(decode)[ids[1]][-1]
    assert out.finished and len(out.output_token_ids) == 30
    assert decode.kv.num_used_blocks == 0


def test_bad_hand_offs_are_refused():
    prefill = LLM(str(STORIES), **ENGINE).engine
    rid = prefill.add_request("One day", greedy(8), hand_off=True).request_id
    handoff = run(prefill)[rid][-1].handoff
    other_block_size = LLM(str(STORIES), device="cpu", dtype="float32", block_size=16).engine
    with pytest.raises(ValueError, match="blocks hold 8 tokens"):
        other_block_size.add_handoff(handoff, greedy(8))
    decode = LLM(str(STORIES), **ENGINE).engine
    with pytest.raises(ValueError, match="laid out as"):  # an engine of another version
        decode.add_handoff(dataclasses.replace(handoff, kv_layout=OLD_KV_LAYOUT), greedy(8))
    with pytest.raises(ValueError, match="has more to sample"):
        decode.add_handoff(handoff, greedy(1))
    decode.add_handoff(handoff, greedy(8))
    with pytest.raises(ValueError, match="already in use"):
        decode.add_handoff(handoff, greedy(8))
    assert decode.kv.num_used_blocks == len(handoff.kv[0, 0])  # the refused ones took nothing


# ---- between processes: torch.distributed point-to-point --------------------------------
def _worker(rank: int, port: int, prompts: list[str], max_tokens: int, kv_cache_dtype: str, results) -> None:
    import torch.distributed as dist

    from travelator.disagg.kv_transport import KVChannel

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=__import__("datetime").timedelta(seconds=120))
    channel = KVChannel(store, rank, 2, timeout_s=120)
    engine = LLM(str(STORIES), **ENGINE, kv_cache_dtype=kv_cache_dtype).engine
    params = greedy(max_tokens)
    if rank == 0:  # the prefill worker
        ids = [engine.add_request(p, params, hand_off=True).request_id for p in prompts]
        first = run(engine)
        for rid in ids:
            channel.send(first[rid][-1].handoff, dst=1)
        results.put(("prefill", [first[rid][-1].text for rid in ids], channel.sent.bytes,
                     engine.kv.num_used_blocks))
    else:  # the decode worker
        ids = [engine.add_handoff(channel.recv(src=0), params).request_id for _ in prompts]
        rest = run(engine)
        results.put(("decode", ["".join(o.new_text for o in rest[rid]) for rid in ids],
                     channel.received.bytes, engine.kv.num_used_blocks))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: codes and scales as bytes
def test_a_hand_off_travels_between_processes(kv_cache_dtype):
    import multiprocessing

    from travelator.server.process import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, PROMPTS, 24, kv_cache_dtype, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict((name, rest) for name, *rest in (results.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (first, sent, used_p), (rest, received, used_d) = got["prefill"], got["decode"]
    ref = LLM(str(STORIES), **ENGINE, kv_cache_dtype=kv_cache_dtype).generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [a + b for a, b in zip(first, rest)] == [r.outputs[0].text for r in ref]
    assert sent == received > 0 and used_p == used_d == 0


def test_a_failed_read_fails_that_request_and_frees_its_blocks():
    prefill = LLM(str(STORIES), **ENGINE).engine
    read = prefill.runner.read_kv_blocks
    calls = []

    def flaky(block_ids):
        calls.append(block_ids)
        if len(calls) == 1:
            raise RuntimeError("lost the cache")
        return read(block_ids)

    prefill.runner.read_kv_blocks = flaky
    ids = [prefill.add_request(p, greedy(8), hand_off=True).request_id for p in PROMPTS[:2]]
    outs = run(prefill)
    last = [outs[rid][-1] for rid in ids]
    assert [o.finish_reason for o in last].count("error") == 1
    assert sum(o.handoff is not None for o in last) == 1
    assert prefill.kv.num_used_blocks == 0


def test_a_stop_string_that_begins_in_the_first_token_is_found_after_the_hand_off():
    """The greedy text goes on ", there was a little girl named Lily": the stop string ", th"
    begins in the prefill engine's token (",") and ends in the decode engine's. The prefill
    engine holds the "," back; the decode engine finds the stop, as one engine would."""
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[", th"])
    ref = LLM(str(STORIES), **ENGINE).generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert (ref.text, ref.finish_reason) == ("", "stop")  # the case this test is about
    prefill, decode = LLM(str(STORIES), **ENGINE).engine, LLM(str(STORIES), **ENGINE).engine
    rid = prefill.add_request("Once upon a time", params, hand_off=True).request_id
    first = run(prefill)[rid][-1]
    assert first.handoff is not None and first.text == ""  # "," held back, not released
    decode.add_handoff(first.handoff, params)
    last = run(decode)[rid][-1]
    assert (last.text, last.finish_reason, last.stop_reason) == ("", "stop", ", th")
