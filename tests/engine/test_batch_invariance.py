"""Batch invariance: with ``batch_invariant=True`` a request's tokens and logprobs are bitwise
the same alone and in any mix of steps (other requests, arrival steps, chunked prefill,
preemption and recompute, prefix-cache hits, either scheduler). With it off they are not, and
the same check says so: it can fail."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paths import STORIES, needs_stories

from travelator import LLM, SamplingParams, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

MODEL = "dummy:tiny"  # vocab 1024, 2 layers, 4 heads, 2 KV heads, head_dim 32
VOCAB = 1024


@dataclass(frozen=True)
class Req:
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy; else sampled at temperature 0.8 with this seed

    def params(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, logprobs=2)
        return SamplingParams(temperature=0.8, seed=self.seed, max_tokens=self.max_tokens,
                              ignore_eos=True, logprobs=2)


Result = tuple[list[int], list[float], list[dict[int, float]]]


def run(llm: LLM, reqs: list[Req]) -> dict[int, Result]:
    """Add each request at its arrival step; collect tokens, logprobs and top logprobs."""
    engine = llm.engine
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_step)
    ids: dict[str, int] = {}
    got: dict[int, Result] = {i: ([], [], []) for i in range(len(reqs))}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and reqs[pending[0]].arrival_step <= step:
            i = pending.pop(0)
            ids[engine.add_request(list(reqs[i].prompt), reqs[i].params()).request_id] = i
        engine.wait_for_admission()  # dynamic batching: wait as a server would
        for out in engine.step():
            assert out.error is None, out.error
            tokens, lps, tops = got[ids[out.request_id]]
            tokens.extend(out.new_token_ids)
            for lp in out.new_logprobs:
                lps.append(lp.logprob)
                tops.append(dict(lp.top_logprobs))
        step += 1
        assert step < 5_000
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return got


_ALONE: dict[tuple, Result] = {}


def alone(req: Req, dtype: str, invariant: bool) -> Result:
    """The request by itself on a fresh engine: its prompt in one step, nothing cached."""
    key = (req.prompt, req.max_tokens, req.seed, dtype, invariant)
    if key not in _ALONE:
        llm = LLM(MODEL, device="cpu", dtype=dtype, batch_invariant=invariant, enable_prefix_caching=False)
        _ALONE[key] = run(llm, [Req(0, req.prompt, req.max_tokens, req.seed)])[0]
    return _ALONE[key]


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 9))
    reqs: list[Req] = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=90))
        if reqs and draw(st.booleans()):  # share an earlier prompt's prefix: a cache hit
            prompt = list(draw(st.sampled_from(reqs)).prompt) + prompt[:20]
        reqs.append(Req(draw(st.integers(0, 12)), tuple(prompt), draw(st.integers(1, 12)),
                        draw(st.one_of(st.none(), st.integers(0, 1000)))))
    engine_kw = dict(
        max_num_seqs=draw(st.integers(1, 12)),
        max_num_batched_tokens=draw(st.sampled_from([16, 40, 100, 300])),
        enable_prefix_caching=draw(st.booleans()),
        batching=draw(st.sampled_from(["iteration", "orca", "dynamic", "static"])),
        max_queue_delay_ms=5,
        block_size=8,
        # A small pool forces preemption and recompute; None sizes it from memory.
        num_kv_blocks=draw(st.sampled_from([None, 20, 40])),
    )
    return reqs, engine_kw


def fits(reqs: list[Req], engine_kw: dict) -> bool:
    """Every request alone must fit the pool (else it is rejected, not preempted)."""
    blocks = engine_kw["num_kv_blocks"]
    return blocks is None or all(len(r.prompt) + r.max_tokens <= blocks * 8 for r in reqs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_outputs_do_not_depend_on_the_batch(dtype, scenario):
    reqs, engine_kw = scenario
    if not fits(reqs, engine_kw):
        return
    llm = LLM(MODEL, device="cpu", dtype=dtype, batch_invariant=True, **engine_kw)
    batched = run(llm, reqs)
    for i, req in enumerate(reqs):
        assert batched[i] == alone(req, dtype, True), (i, engine_kw)


def mixed_batch(seed: int) -> list[Req]:
    rng = random.Random(seed)
    return [Req(rng.randint(0, 3), tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 80))),
                10, None) for _ in range(8)]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_without_the_mode_batching_changes_the_numbers_unless_the_routes_are_row_independent(dtype):
    """The check above can fail: the default mode gives different logprobs in a batch (in
    bf16, where a few rows stream the weights and more take the GEMM; float32 weights take
    oneDNN's packed GEMM at every row count, whose rows came out the same here). Where the bf16
    weights take panel_linear (AVX2 CPUs), one kernel at every row count whose rows never
    depend on each other, the default mode's numbers do not change with the batch either."""
    from travelator.model.linear_route import LinearRoute

    reqs = mixed_batch(0)
    llm = LLM(MODEL, device="cpu", dtype=dtype, max_num_seqs=8, max_num_batched_tokens=100)
    model = llm.engine.runner.model
    panels = all(model.ops.linear_route(layer.mlp.down_weight) is LinearRoute.PANELS for layer in model.layers)
    batched = run(llm, reqs)
    differ = [i for i, r in enumerate(reqs) if batched[i][1] != alone(r, dtype, False)[1]]
    if panels:
        assert not differ, "panel_linear's rows should not depend on the batch"
    else:
        assert differ, "expected some request's logprobs to change with the batch"


@pytest.mark.parametrize("batching", ["iteration", "orca", "dynamic", "static"])
def test_preemption_and_prefix_hits_keep_the_numbers(batching):
    """A deterministic case that surely preempts and surely hits the prefix cache."""
    rng = random.Random(1)
    shared = tuple(rng.randrange(3, VOCAB) for _ in range(48))
    reqs = [Req(0, shared, 12, None), Req(4, shared + (5, 6, 7), 12, 3)]
    reqs += [Req(5, tuple(rng.randrange(3, VOCAB) for _ in range(40)), 12, None) for _ in range(4)]
    llm = LLM(MODEL, device="cpu", dtype="bfloat16", batch_invariant=True, batching=batching, max_queue_delay_ms=5, block_size=8,
              num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=32)
    batched = run(llm, reqs)
    counters = llm.engine.counters
    assert counters.preemptions > 0
    assert llm.engine.kv.stats.hit_tokens > 0
    for i, req in enumerate(reqs):
        assert batched[i] == alone(req, "bfloat16", True), i


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "gpt_oss"])
def test_the_new_architectures_keep_the_mode(family, tmp_path):
    """Qwen3 (head norms, in the Python layers and the native layer stack), Phi-3 (partial
    rotary), Gemma 3 (sandwich norms in torch, GeGLU, sliding layers beside global ones) and the
    mixtures of experts (a token's experts and their sums whatever shares the step): the
    same bits alone and in a batch with chunked prefill, preemption and prefix hits."""
    from hf_models import (build_checkpoint, gemma3_overrides, gpt_oss_overrides, mixtral_overrides, phi3_overrides,
                           qwen3_moe_overrides)

    overrides = {"qwen3": {"head_dim": 32}, "phi3": phi3_overrides(original=512, maximum=512),
                 "gemma3": gemma3_overrides(window=5), "mixtral": mixtral_overrides(),
                 "qwen3_moe": qwen3_moe_overrides(), "gpt_oss": gpt_oss_overrides()}[family]
    model = str(build_checkpoint(tmp_path / family, family, **overrides))
    rng = random.Random(7)
    reqs = [Req(rng.randint(0, 3), tuple(rng.randrange(3, 300) for _ in range(rng.randint(5, 80))), 10, None)
            for _ in range(8)]
    reqs += [Req(4, reqs[0].prompt + (5, 6, 7), 6, 3)]  # a prefix hit, sampled
    llm = LLM(model, device="cpu", dtype="bfloat16", batch_invariant=True, block_size=8, num_kv_blocks=24,
              max_num_batched_tokens=40)
    batched = run(llm, reqs)
    assert llm.engine.counters.preemptions > 0 and llm.engine.kv.stats.hit_tokens > 0
    single = LLM(model, device="cpu", dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False)
    for i, req in enumerate(reqs):
        assert batched[i] == run(single, [Req(0, req.prompt, req.max_tokens, req.seed)])[0], i


def test_the_mode_needs_the_native_kernels():
    with pytest.raises(ValueError, match="batch_invariant needs the native CPU kernels"):
        LLM(MODEL, device="cpu", kernels="torch", batch_invariant=True)


@needs_stories
def test_stories260k_sampled_text_is_the_same_alone_and_in_any_batch():
    """A trained model, sampled at temperature 0.8 with fixed seeds: the text of each
    request alone equals its text inside batches of different sizes and budgets."""
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]
    params = [SamplingParams(temperature=0.8, seed=11 * i, max_tokens=40, logprobs=1)
              for i in range(len(prompts))]
    alone_outs = []
    for p, sp in zip(prompts, params):
        llm = LLM(str(STORIES), device="cpu", batch_invariant=True)
        alone_outs.append(llm.generate([p], [sp], use_tqdm=False)[0].outputs[0])
    for kw in (dict(max_num_seqs=4), dict(max_num_seqs=2, max_num_batched_tokens=8)):
        llm = LLM(str(STORIES), device="cpu", batch_invariant=True, **kw)
        outs = llm.generate(prompts * 3, params * 3, use_tqdm=False)  # each prompt three times
        for i, out in enumerate(outs):
            ref = alone_outs[i % len(prompts)]
            assert out.outputs[0].token_ids == ref.token_ids, (kw, i)
            assert [lp.logprob for lp in out.outputs[0].logprobs] == [lp.logprob for lp in ref.logprobs]


def test_tensor_parallel_two_ranks_is_invariant_too():
    """TP=2 (the all-reduce in rank order): each request alone on the engine, then all of
    them together, bitwise the same."""
    reqs = mixed_batch(2)
    llm = LLM(MODEL, device="cpu", dtype="float32", batch_invariant=True, tensor_parallel_size=2,
              enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=100)
    try:
        alone_results = [run(llm, [Req(0, r.prompt, r.max_tokens, r.seed)])[0] for r in reqs]
        batched = run(llm, reqs)
    finally:
        llm.shutdown()
    for i in range(len(reqs)):
        assert batched[i] == alone_results[i], i


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_are_invariant_too(quantization):
    """int8/int4 linear layers (torch's kernels) run in the mode's fixed tiles of rows too:
    each request alone on the engine, then all of them together, bitwise the same. (On this
    machine it passes without the tiles as well: these CPU kernels compute each row on its
    own; the tiles make it hold wherever a kernel would not.)"""
    reqs = mixed_batch(3)
    llm = LLM(MODEL, device="cpu", dtype="bfloat16", batch_invariant=True, quantization=quantization,
              quantization_group_size=32, enable_prefix_caching=False, max_num_seqs=8,
              max_num_batched_tokens=100)
    alone_results = [run(llm, [Req(0, r.prompt, r.max_tokens, r.seed)])[0] for r in reqs]
    batched = run(llm, reqs)
    for i in range(len(reqs)):
        assert batched[i] == alone_results[i], i
