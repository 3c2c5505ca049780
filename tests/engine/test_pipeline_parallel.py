"""Pipeline parallelism on CPU over gloo: PP=2 against PP=1 and transformers (tokens and
logprobs), what each stage holds, and what happens when a stage dies.

Stages are real processes launched by the engine (one torch thread each here).
"""

from __future__ import annotations

import random

import pytest

from hf_models import build_checkpoint, load_reference, reference_greedy
from paths import STORIES, needs_stories
from staggered import greedy, run_staggered
from tp_deadline import one_thread_per_worker_and_a_deadline
from travelator import LLM
from travelator.engine.outputs import TokenLogprob
from travelator.model.pp_stage import stage_bounds

# Chunked prefill (7-token budget) and preemption (12 blocks of 8 tokens for 10 requests of up
# to 61 + 20 tokens) in the same run, as in the tensor-parallel tests.
TIGHT = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_num_batched_tokens=7)


@pytest.fixture(autouse=True)
def _one_thread_per_worker_and_a_deadline(monkeypatch):
    yield from one_thread_per_worker_and_a_deadline(monkeypatch, 90, "pipeline-parallel test")


def make_requests(n: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens): staggered, prompts of 3 to 60 tokens."""
    rng = random.Random(seed)
    return [(rng.randint(0, 12), [1] + [rng.randrange(3, 300) for _ in range(rng.randint(3, 60))],
             rng.randint(1, 20)) for _ in range(n)]


def test_stages_are_contiguous_and_balanced():
    assert [stage_bounds(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_bounds(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [stage_bounds(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_bounds(2, 3, 0)


def expected_stage_bytes(one: LLM, size: int) -> list[int]:
    """Each stage's weight bytes, counted from the one-rank model's parameters: its layers, the
    embedding on the first stage (and on the last with tied embeddings), the final norm and the
    LM head on the last."""
    arch = one.engine.arch
    params = dict(one.engine.runner.model.named_parameters())
    total = []
    for rank in range(size):
        start, end = stage_bounds(arch.num_layers, size, rank)
        last = rank == size - 1
        held = [n for n in params if n.startswith("layers.") and start <= int(n.split(".")[1]) < end]
        held += ["embed"] if rank == 0 or (last and arch.tie_word_embeddings) else []
        held += ["norm.weight"] + ([] if arch.tie_word_embeddings else ["lm_head"]) if last else []
        total.append(sum(params[n].numel() * params[n].element_size() for n in held))
    return total


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pp2_matches_pp1_and_transformers(family, tmp_path):
    """Chunked prefill (7-token budget) and preemption (12 blocks of 8 tokens) in one run.
    llama: tied embeddings (the last stage keeps its own copy as the head), 2 layers, one per
    stage; qwen3: an untied head and 3 layers, split 2 + 1."""
    overrides = {"llama": {"tie_word_embeddings": True},
                 "qwen3": {"head_dim": 32, "num_hidden_layers": 3, "tie_word_embeddings": False}}[family]
    path = build_checkpoint(tmp_path, family, **overrides)
    reqs = make_requests(10, seed=11)
    one = LLM(str(path), device="cpu", **TIGHT)
    want = run_staggered(one, reqs)
    assert one.engine.counters.preemptions > 0
    two = LLM(str(path), device="cpu", pipeline_parallel_size=2, **TIGHT)
    try:
        got = run_staggered(two, reqs)
        # Two micro-batches in flight (the default: one per stage), each preempting on its own.
        assert two.engine.runner.most_in_flight == 2
        assert two.engine.counters.preemptions > 0
        mem = two.engine.runner.call("memory")
    finally:
        two.shutdown()
    assert got == want
    ref = load_reference(path)
    for i, (_, prompt, m) in enumerate(reqs):
        assert got[i] == reference_greedy(ref, prompt, m), f"request {i} differs"
    # Each stage holds only its layers' weights and KV.
    assert [m["weights"] for m in mem] == expected_stage_bytes(one, 2)
    num_layers = one.engine.arch.num_layers
    kv_layer = sum(k.numel() * k.element_size() * 2 for k, _ in one.engine.runner.kv_caches) // num_layers
    assert [m["kv_cache"] for m in mem] == [kv_layer * (e - s) for s, e in
                                            (stage_bounds(num_layers, 2, r) for r in range(2))]


def logprob_run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's tokens, and per sampled and prompt position its top logprobs."""
    outs = llm.generate(prompts, greedy(12, logprobs=3, prompt_logprobs=2), use_tqdm=False)
    return [(o.token_ids, [top(lp) for lp in o.outputs[0].logprobs + o.prompt_logprobs[1:]]) for o in outs]


def top(lp: TokenLogprob) -> dict[int, float]:
    return {lp.token_id: lp.logprob, **lp.top_logprobs}


@needs_stories
def test_stories_pp2_tokens_and_logprobs_equal_pp1():
    """A real checkpoint (5 layers: 3 + 2), in chunks with preemption: the same tokens, and
    the same logprobs to float tolerance."""
    prompts = [[1] + list(range(20 + i, 60 + 3 * i)) for i in range(6)]
    settings = dict(dtype="float32", block_size=8, num_kv_blocks=14, max_num_batched_tokens=16)
    one = LLM(str(STORIES), device="cpu", **settings)
    want = logprob_run(one, prompts)
    assert one.engine.counters.preemptions > 0
    two = LLM(str(STORIES), device="cpu", pipeline_parallel_size=2, **settings)
    try:
        got = logprob_run(two, prompts)
        assert two.engine.counters.preemptions > 0 and two.engine.runner.most_in_flight == 2
    finally:
        two.shutdown()
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        for pos, want_pos in zip(lps, want_lps, strict=True):
            assert pos.keys() == want_pos.keys()
            for t in pos:
                assert pos[t] == pytest.approx(want_pos[t], abs=1e-4)


# float32 is test_pp2_matches_pp1_and_transformers's.
@pytest.mark.parametrize("weights", [dict(device="cpu", dtype="bfloat16"),
                                     dict(device="cpu", dtype="float32", quantization="int8")])
def test_dummy_weights_same_model_under_pp(weights):
    """Every stage draws the whole model's stream and keeps its part: the same model as one rank
    (bfloat16 hidden states and logits between stages; int8 weights quantized per stage)."""
    prompts = [[1, 5, 6, 7, 8], [1] + list(range(100, 140))]
    one = LLM("dummy:tiny", num_kv_blocks=16, **weights)
    want = [r.token_ids for r in one.generate(prompts, greedy(10), use_tqdm=False)]
    two = LLM("dummy:tiny", num_kv_blocks=16, pipeline_parallel_size=2, **weights)
    try:
        got = [r.token_ids for r in two.generate(prompts, greedy(10), use_tqdm=False)]
        assert "pipeline parallel over 2 stages" in two.engine.runner.describe()
    finally:
        two.shutdown()
    assert got == want


def test_two_steps_in_flight_unless_told_one_and_an_abort_in_flight():
    """The driver sends step t+1 through the stages before it lands step t's tokens (its
    hidden-state send to stage 2 completes only once stage 2 takes it), unless told to run one
    step at a time; the tokens are one rank's either way. A request aborted while its step is
    in flight ends at once; the others go on, and every rank forgets it."""
    prompts = [[1] + list(range(10 + 7 * i, 30 + 9 * i)) for i in range(4)]
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16)
    want = [r.token_ids for r in LLM("dummy:tiny", **settings).generate(prompts, greedy(8), use_tqdm=False)]
    llm = LLM("dummy:tiny", pipeline_parallel_size=2, **settings)
    engine, runner = llm.engine, llm.engine.runner
    try:
        engine.set_steps_in_flight(1)
        one_at_a_time = [r.token_ids for r in llm.generate(prompts, greedy(8), use_tqdm=False)]
        assert runner.most_in_flight == 0
        engine.set_steps_in_flight(2)
        assert [r.token_ids for r in llm.generate(prompts, greedy(8), use_tqdm=False)] == want == one_at_a_time
        assert runner.most_in_flight == 2

        ids = [engine.add_request(p, greedy(8)).request_id for p in prompts]
        finished = {o.request_id: o for o in engine.step() if o.finished}
        (flying,) = engine._flights  # one step landed, the next in flight
        victim = next(iter(flying.num_scheduled_tokens))
        (aborted,) = engine.abort_request([victim])
        assert aborted.finish_reason == "abort" and engine.kv.block_ids(victim) == []
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert victim not in finished
        assert {rid: finished[rid].output_token_ids for rid in ids if rid != victim} == \
            {rid: want[i] for i, rid in enumerate(ids) if rid != victim}
        engine.step()  # nothing to run: the freed ids reach every rank
        assert runner.held_request_ids() == set() and engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        llm.shutdown()


def test_tensor_and_pipeline_together_are_refused():
    with pytest.raises(ValueError, match="tensor and pipeline parallelism together are not supported"):
        LLM("dummy:tiny", device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)


def test_more_stages_than_layers_are_refused():
    layers = LLM("dummy:tiny", device="cpu", num_kv_blocks=4).engine.arch.num_layers
    with pytest.raises(ValueError, match="each stage needs at least one layer"):
        LLM("dummy:tiny", device="cpu", pipeline_parallel_size=layers + 1)


def test_scores_match_and_embeddings_are_refused_under_pp():
    """Scores read the last prompt row's logits, which the last stage sends back: one rank's
    numbers. Embeddings need the final hidden states, which stay on the last stage: a 400 on
    ``pooling`` before anything is queued."""
    from travelator.errors import InvalidRequestError
    from travelator.scoring import ScoreFormat

    fmt = ScoreFormat("q: {query} d: {document} ->", ("a", "b"))
    one = LLM("dummy:tiny", device="cpu", dtype="float32", max_num_batched_tokens=8)
    want = one.score("which", ["one text", "another"], score_format=fmt, use_tqdm=False)
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", max_num_batched_tokens=8, pipeline_parallel_size=2)
    try:
        got = llm.score("which", ["one text", "another"], score_format=fmt, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="embeddings need pipeline_parallel_size 1") as err:
            llm.embed([[1, 5, 6, 7]], use_tqdm=False)
        assert err.value.param == "pooling"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()
    assert got == pytest.approx(want, abs=1e-5)
