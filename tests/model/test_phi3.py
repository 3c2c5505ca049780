"""Phi-3 / Phi-4-mini specifics against transformers: LongRoPE's two sets of factors and its
attention factor, and partial rotary. (Fused QKV and gate/up tensors, chunked prefill,
preemption and bf16 are in test_model_vs_transformers.py's phi3 family.)

LongRoPE picks its factors by the engine's context, as llama.cpp does: short factors where the
context stays within the pretraining length (``original_max_position_embeddings``), long ones
where it passes it. transformers picks by the length of the sequence in each forward pass,
which is the same choice for a sequence on one side of that length: the short regime is tested
with short sequences, the long one with prompts past it."""

from __future__ import annotations

import random

import pytest

from hf_models import assert_greedy_matches, build_checkpoint, load_reference, phi3_overrides
from travelator import LLM, SamplingParams

ORIGINAL, MAXIMUM = 64, 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", **phi3_overrides(ORIGINAL, MAXIMUM))
    return path, load_reference(path)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 300) for _ in range(length - 1)]


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("regime", ["short", "long"])
def test_longrope_matches_transformers(checkpoint, kernels, regime):
    path, ref = checkpoint
    if regime == "short":  # a context within the pretraining length, short sequences
        llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels, max_model_len=ORIGINAL)
        prompts, new = [prompt_of(n, n) for n in (5, 20, 40)], 16
    else:  # the default context (256 > 64): prompts already past the pretraining length
        llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels, max_num_batched_tokens=48)
        prompts, new = [prompt_of(n, n) for n in (65, 90, 150)], 16
    assert_greedy_matches(llm, ref, prompts, new, 2e-4)


def test_the_regime_is_the_engines_context(checkpoint):
    """The same short prompt under the two contexts: a different model (the factors differ)."""
    path, _ = checkpoint
    prompt = prompt_of(30, 3)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    short = LLM(str(path), dtype="float32", max_model_len=ORIGINAL).generate([prompt], params, use_tqdm=False)
    long = LLM(str(path), dtype="float32").generate([prompt], params, use_tqdm=False)
    assert short[0].outputs[0].logprobs[0].top_logprobs != long[0].outputs[0].logprobs[0].top_logprobs
