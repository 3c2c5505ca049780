"""gpt-oss beyond tests/model/test_model_vs_transformers.py: a checkpoint whose experts are
MXFP4 (blocks of 32 four-bit e2m1 codes and a power-of-two scale each, as the released ones
ship), kept 4-bit, against transformers' own dequantizing load, and YaRN's frequencies against
transformers' rope functions."""

from __future__ import annotations


import pytest
import torch

from hf_models import mxfp4_checkpoint, reference_greedy, reference_logprobs
from travelator import LLM, SamplingParams
from travelator.model.layers import rope_inv_freq
from travelator.model.quant import Int4Weight


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    return path, ref


# torch: the kept 4-bit experts dequantized exactly; native: the integer kernel, whose integer
# form of x (quant_linear.cpp) is the difference.
@pytest.mark.parametrize("kernels,tolerance", [("torch", 1e-4), ("native", 3e-3)])
def test_mxfp4_experts_stay_4_bit_and_match_transformers_dequantizing_them(mxfp4_model, kernels, tolerance):
    path, ref = mxfp4_model
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    weight = experts[3].gate_up_weight
    assert isinstance(weight, Int4Weight) and weight.codebook == "e2m1"
    # 4-bit codes, and a bf16 scale and zero per 32 inputs: 5 bits a weight
    assert weight.nbytes == weight.out_features * weight.in_features * 5 // 8
    prompt = [1, 7, 99, 250, 3, 18, 42, 77, 5, 9, 11, 13, 15, 17]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference_greedy(ref, prompt, 8)
    want = reference_logprobs(ref, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.logprob == pytest.approx(float(want[len(prompt) - 1 + i, token]), abs=tolerance)


@pytest.mark.parametrize("scaling", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 8.0, "original_max_position_embeddings": 2048},  # truncated, default betas
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "attention_factor": 1.25, "original_max_position_embeddings": 1024},
])
def test_yarn_matches_transformers(scaling):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(scaling, rope_type="yarn", rope_theta=150000.0)
    cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=64, rope_parameters=rope,
                       max_position_embeddings=131072)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = rope_inv_freq(64, 150000.0, rope, 131072)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)
