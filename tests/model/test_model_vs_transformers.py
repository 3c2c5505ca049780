"""travelator against transformers on tiny random-init Llama, Qwen2, Qwen3, Mistral (one with a
sliding window shorter than the prompts), Phi-3, Gemma 3, Mixtral and Qwen3-MoE models: logits and greedy tokens, alone and
mixed in batches with staggered arrivals, chunked prefill and preemption."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hf_models import (build_checkpoint, gemma3_overrides, gpt_oss_overrides, load_reference, mixtral_overrides,
                       phi3_overrides, qwen3_moe_overrides, randomize, reference_greedy, reference_logprobs)
from staggered import greedy, run_staggered
from travelator import LLM, SamplingParams

FAMILIES = {
    "llama": {},
    "qwen2": {},
    # A window shorter than nearly every prompt (3-60 tokens, then up to 24 generated), so that
    # every test below runs through it.
    "mistral_w7": {"sliding_window": 7},
    # Per-head q/k RMSNorm, tied embeddings as on the small Qwen3 sizes, and a head_dim that is
    # not hidden / heads (Qwen3-0.6B: 1024 / 16 heads with head_dim 128).
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},
    # Fused QKV and gate/up tensors, partial rotary, LongRoPE's short factors (the context stays
    # within the pretraining length; tests/model/test_phi3.py takes the long ones).
    "phi3": phi3_overrides(original=512, maximum=512, head_dim=16),
    # Sandwich and unit-offset norms (random here: transformers initialises them to zero), head
    # q/k norms, GeGLU, the scaled embedding, query_pre_attn_scalar, a rope per kind of layer,
    # and sliding layers with a window of 5 beside global ones.
    "gemma3_w5": gemma3_overrides(window=5),
    # Llama 3 style: tied embeddings and llama3 rope scaling.
    "llama3": {"tie_word_embeddings": True, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # head_dim 64: the vectorised path of the native attention kernel (16 takes the portable one).
    "llama_hd64": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "initializer_range": 0.25},
    # Mixtures of experts: Mixtral's 8 experts, top-2; Qwen3-MoE's 16 small ones, top-4,
    # renormalised, with q/k head norms and a dense layer among the sparse ones.
    "mixtral": mixtral_overrides(),
    "qwen3_moe": qwen3_moe_overrides(),
    # gpt-oss: sinks, sliding layers (a window of 5) alternating with full ones, YaRN, biased
    # router, experts (clamped SwiGLU, gate and up interleaved in the checkpoint) and attention.
    # Weights of half the usual scale: at 0.5, with its random biases, transformers' own float32
    # run is 4e-4 off float64, past the prompt-logprob test's bound.
    "gpt_oss": dict(gpt_oss_overrides(window=5), initializer_range=0.25),
}
# The transformers family of each case, where its name is not the family.
FAMILY_OF = {"mistral_w7": "mistral", "gemma3_w5": "gemma3", "llama3": "llama", "llama_hd64": "llama"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    name = request.param
    family = FAMILY_OF.get(name, name)
    path = build_checkpoint(tmp_path_factory.mktemp(name), family, **FAMILIES[name])
    if family == "gemma3":
        randomize(path, ("norm.weight",), 0.5)  # unit offset: scales of 0.5 to 1.5
    elif family == "gpt_oss":  # transformers starts the experts' biases at zero
        randomize(path, ("bias", "sinks"), 0.5)
    if family in ("mixtral", "qwen3_moe", "gpt_oss"):
        # Routers with wide margins between experts: a near tie would flip under bf16 rounding
        # (or a float32 summation order) and move the logits by a nat, bug or not.
        randomize(path, ("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight"), 3.0, seed=2)
    elif family in ("qwen3", "qwen3_moe"):
        randomize(path, ("q_norm.weight", "k_norm.weight"), 0.5, offset=1.0)
    return path, load_reference(path)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# Both kernel sets: the native CPU kernels (the default here) and the pure-torch fallback.
KERNELS = ["native", "torch"]


@pytest.mark.parametrize("kernels", KERNELS)
def test_logprobs_match(checkpoint, kernels):
    """Logprobs against transformers run in float64 (near the exact result: only its rope
    tables stay float32): within 1e-4, or within twice transformers' own float32 error (its
    largest over the top-5 logprobs of the tokens checked) where that is larger: llama_hd64's
    large logits put float32 transformers up to 3.4e-4 off float64, and another float32
    implementation may err as much the other way (gpt_oss on an AVX-512 Xeon: 1.6x)."""
    path, ref = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    prompt = prompts(1, seed=1, lo=40, hi=40)[0]
    result = llm.generate([prompt], greedy(8, logprobs=5), use_tqdm=False)[0].outputs[0]
    tokens = prompt + result.token_ids
    ref_lp = reference_logprobs(ref, tokens).double()
    exact_lp = reference_logprobs(copy.deepcopy(ref).double(), tokens)
    rows = slice(len(prompt) - 1, len(tokens) - 1)
    # The checkpoint's float32 error: transformers' largest over the logprobs checked.
    float32_error = float((ref_lp[rows] - exact_lp[rows]).abs().gather(
        1, ref_lp[rows].topk(5).indices).max())
    bound = max(1e-4, 2 * float32_error)
    for i, entry in enumerate(result.logprobs):
        row, exact = ref_lp[len(prompt) - 1 + i], exact_lp[len(prompt) - 1 + i]
        assert entry.token_id == int(row.argmax())
        top_ids = sorted(entry.top_logprobs, key=entry.top_logprobs.get, reverse=True)
        assert top_ids == row.topk(5).indices.tolist()
        assert entry.logprob == pytest.approx(float(exact[entry.token_id]), abs=bound)
        for tok, lp in entry.top_logprobs.items():
            assert lp == pytest.approx(float(exact[tok]), abs=bound), (i, tok, float32_error)


def test_transformers_applies_mistrals_window(tmp_path):
    """The reference is a windowed one: with its default attention in float32, a query 7 or
    more positions in sees less with sliding_window 7 than without a window."""
    ref = load_reference(build_checkpoint(tmp_path, "mistral", **FAMILIES["mistral_w7"]))
    tokens = prompts(1, seed=6, lo=40, hi=40)[0]
    windowed = reference_logprobs(ref, tokens)
    ref.config.sliding_window = None
    full = reference_logprobs(ref, tokens)
    torch.testing.assert_close(windowed[:7], full[:7])
    assert (windowed[7:] - full[7:]).abs().amax(-1).min() > 1e-3


def check_against_reference(ref, llm: LLM, n: int, seed: int, lo: int = 3, hi: int = 60) -> LLM:
    rng = random.Random(seed)
    reqs = [(rng.randint(0, 12), p, rng.randint(1, 24)) for p in prompts(n, seed, lo, hi)]
    got = run_staggered(llm, reqs)
    for i, (_, prompt, m) in enumerate(reqs):
        assert got[i] == reference_greedy(ref, prompt, m), f"request {i} differs"
    return llm


def test_staggered_batch_matches_alone(checkpoint):
    path, ref = checkpoint
    check_against_reference(ref, LLM(str(path), dtype="float32"), n=10, seed=2)


@pytest.mark.parametrize("kernels", KERNELS)
def test_chunked_prefill_matches(checkpoint, kernels):
    path, ref = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=7, kernels=kernels)
    check_against_reference(ref, llm, n=9, seed=3)
    assert llm.engine.counters.steps > 0


def test_preemption_matches(checkpoint):
    path, ref = checkpoint
    # 12 blocks of 8 tokens: the longest request (61 + 24 tokens) fits alone, the
    # batch does not, so requests are preempted and recomputed.
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=12)
    if llm.engine.kv.sliding_window is not None:
        # Every layer slides (mistral_w7): a request holds only the blocks of its window, and
        # these requests never fill that pool. Many short ones (up to 11 + 24 tokens) fill 5
        # blocks as they grow, and are preempted and recomputed with blocks given back.
        llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=5)
        check_against_reference(ref, llm, n=16, seed=4, hi=10)
    else:
        check_against_reference(ref, llm, n=10, seed=4)
    assert llm.engine.counters.preemptions > 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_bfloat16_runs_close_to_reference(checkpoint, kernels):
    path, ref = checkpoint
    llm = LLM(str(path), device="cpu", dtype="bfloat16", kernels=kernels)
    prompt = prompts(1, seed=5, lo=30, hi=30)[0]
    # A prefill, then decode steps of one request (the native one-row linear kernel).
    out = llm.generate([prompt], greedy(4, logprobs=1), use_tqdm=False)[0].outputs[0]
    ref_lp = reference_logprobs(ref, prompt + out.token_ids[:-1])[len(prompt) - 1:]
    # transformers' own bf16 run of the same tokens: how far bf16 itself moves this model.
    bf16_lp = reference_logprobs(copy.deepcopy(ref).to(torch.bfloat16), prompt + out.token_ids[:-1])
    bf16_lp = bf16_lp[len(prompt) - 1:].float()
    # bfloat16 keeps ~3 significant digits; each token's log-probability stays close.
    # The reference runs in float32: after a few steps the rounding differences of these
    # sharp random models reach 0.3-0.4 on either kernel set (and near-ties may flip), so
    # decode steps get a wider bound, and any step the bound of transformers' own bf16 error
    # where that is larger (phi3's first token: 0.4); a broken kernel is off by several nats.
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        own_error = abs(float(bf16_lp[step][token]) - float(ref_lp[step][token]))
        bound = max(0.15 if step == 0 else 0.5, 1.5 * own_error)
        assert lp.logprob == pytest.approx(float(ref_lp[step][token]), abs=bound), step
        assert torch.isfinite(torch.tensor(lp.logprob))


@pytest.mark.parametrize("kernels", KERNELS)
def test_prompt_logprobs_match(checkpoint, kernels):
    """Prompt logprobs (teacher-forced: each prompt token under the prompt before it) against
    transformers' log-softmax, with prompts chunked in 7-token steps, a pool small enough to
    preempt, and a shared prefix that must not come from the prefix cache (no logits there)."""
    path, ref = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels, max_num_batched_tokens=7, block_size=8,
              num_kv_blocks=10)
    # A model whose every layer slides (mistral_w7) holds only its windows' blocks, and these
    # prompts, prefilled one at a time, never fill that pool: here it holds every block, as a
    # model with full layers does, so that the pool preempts.
    llm.engine.kv.sliding_window = None
    ps = prompts(4, seed=9, lo=20, hi=40)
    ps.append(ps[0] + [5, 6, 7])  # shares its prefix with the first prompt
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, prompt_logprobs=3)
              for m in (0, 12, 20, 1, 16)]
    results = llm.generate(ps, params, use_tqdm=False)
    for prompt, res, p in zip(ps, results, params):
        want = reference_logprobs(ref, prompt)
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
        assert len(res.outputs[0].token_ids) == p.max_tokens
        for i, entry in enumerate(res.prompt_logprobs[1:], start=1):
            assert entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(float(want[i - 1][prompt[i]]), abs=5e-4)
            higher = lambda margin: int((want[i - 1] > want[i - 1][prompt[i]] + margin).sum())  # noqa: E731
            assert 1 + higher(1e-3) <= entry.rank <= 1 + higher(-1e-3)
            top = torch.topk(want[i - 1], 3)
            assert list(entry.top_logprobs) == top.indices.tolist()
            assert list(entry.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=5e-4)
    assert llm.engine.counters.preemptions > 0
    assert llm.engine.kv.stats.hit_tokens == 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_mistral_window_gives_back_blocks(tmp_path, kernels):
    """Window 16 in blocks of 16: a 300-token request holds at most window / block_size + 1
    blocks once its prompt is in (those behind its window go back to the pool), and its greedy
    tokens are transformers'. Without prefix caching a released block is handed out again at
    once, here to the request itself, whose table still names it at its old positions (which
    no kernel reads); with it, the same prompt again takes the released, still cached prompt
    blocks as hits, and gets the same tokens."""
    path = build_checkpoint(tmp_path, "mistral", sliding_window=16)
    ref = load_reference(path)
    prompt = prompts(1, seed=7, lo=40, hi=40)[0]  # 41 tokens, then 259 more
    want = reference_greedy(ref, prompt, 259)
    for caching in (False, True):
        llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels, block_size=16, num_kv_blocks=19,
                  enable_prefix_caching=caching)
        kv = llm.engine.kv
        assert kv.sliding_window == 16
        held, used, allocate = {}, set(), kv.allocate_slots

        def tracked(req, *args):  # blocks held once a step's blocks are allocated
            got = allocate(req, *args)
            held[req.num_computed_tokens] = (len(kv.held_block_ids(req.request_id)), len(kv.block_ids(req.request_id)))
            used.update(kv.held_block_ids(req.request_id))
            return got

        kv.allocate_slots = tracked
        assert llm.generate([prompt], greedy(259), use_tqdm=False)[0].outputs[0].token_ids == want
        decodes = [n for computed, (n, _) in held.items() if computed >= len(prompt)]
        assert len(decodes) == 258 and max(decodes) == 16 // 16 + 1  # the prompt's step sampled the first
        assert held[max(held)][1] == 19  # the table still spans positions 0 .. 298
        assert kv.num_used_blocks == 0 and kv.stats.hit_tokens == 0
        kv.check_consistency()
        if not caching:
            assert len(used) <= 4  # the prompt's 3 blocks and one more, over and over
            continue
        assert len(used) == 19  # keyed blocks wait at the back of the free list
        assert llm.generate([prompt], greedy(259), use_tqdm=False)[0].outputs[0].token_ids == want
        assert kv.stats.hit_tokens == 32
