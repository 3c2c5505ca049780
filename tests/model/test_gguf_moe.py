"""GGUF files of mixtures of experts, written here as llama.cpp's converter writes them (each
projection's experts stacked in one tensor, the router as ffn_gate_inp; Mixtral as a llama file
with experts and Q/K rows permuted for its rope), against transformers on the HF checkpoint
they came from. transformers' own GGUF reader checks the Qwen3-MoE writer (it reads no Mixtral
GGUF); a file of Q4_0 or MXFP4 experts keeps them 4-bit and runs the model they hold."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gguf_files import VOCAB, add_shape, add_vocab, finish
from hf_models import (assert_greedy_matches, build_checkpoint, load_reference, mixtral_overrides,
                       qwen3_moe_overrides, randomize, reference_logprobs)
from travelator import LLM, SamplingParams

PROJECTIONS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
               "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: a llama file's Q/K rows rotate adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, family: str, quant: gguf.GGMLQuantizationType | None = None) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}[family]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    add_shape(w, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(VOCAB)
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_vocab(w)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        data = tensor.float().numpy()
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.<mlp>.experts.E.<proj>.weight
            layer, expert, proj = parts[2], int(parts[5]), parts[6]
            experts.setdefault((layer, PROJECTIONS[proj]), {})[expert] = data
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if family == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute(data, cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        w.add_tensor(gguf_name, data)
    for (layer, kind), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float32)
        if quant is None:
            w.add_tensor(f"blk.{layer}.{kind}.weight", stacked)
        else:
            w.add_tensor(f"blk.{layer}.{kind}.weight", gguf.quants.quantize(stacked, quant), raw_dtype=quant)
    finish(w)
    return out


# Every Qwen3-MoE layer sparse, as in the released models (llama.cpp's qwen3moe has no dense
# layers), and experts of Qwen3MoeConfig's default width: transformers' GGUF reader does not read
# expert_feed_forward_length, which llama.cpp's converter writes.
CASES = {"mixtral": mixtral_overrides(),
         "qwen3_moe": dict(qwen3_moe_overrides(), mlp_only_layers=[], moe_intermediate_size=768)}
PROMPTS = [[1, 7, 99, 250, 3, 18, 42], [1] + list(range(40, 90))]


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    overrides = dict(CASES[family], hidden_size=64)
    hf_dir = build_checkpoint(root / "hf", family, **overrides)
    if family == "qwen3_moe":  # transformers initialises the head norms to ones
        randomize(hf_dir, ("q_norm.weight", "k_norm.weight"), 0.5, offset=1.0)
    return family, hf_dir, write_gguf(hf_dir, root / f"{family}.gguf", family), load_reference(hf_dir)


def test_transformers_reads_the_qwen3_moe_file_as_the_checkpoint(model):
    from transformers import AutoModelForCausalLM

    family, _, path, ref = model
    if family != "qwen3_moe":
        pytest.skip("transformers reads no Mixtral GGUF")
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     experts_implementation="eager").eval()
    tokens = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(from_gguf(tokens).logits, ref(tokens).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_travelator_on_the_gguf_matches_transformers(model, kernels):
    family, hf_dir, path, ref = model
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    arch = llm.engine.arch
    hf_arch = LLM(str(hf_dir), device="cpu", dtype="float32", num_kv_blocks=8).engine.arch
    assert (arch.family, arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size) == (
        family, hf_arch.num_experts, hf_arch.experts_per_token, hf_arch.expert_intermediate_size)
    assert arch.norm_topk_prob and arch.dense_layers == hf_arch.dense_layers
    assert_greedy_matches(llm, ref, PROMPTS, 10, 1e-4)


def dequantized_reference(ref, path: Path, family: str):
    """The reference with its experts replaced by the file's, dequantized by gguf-py: the model
    the quantized file holds."""
    import copy

    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    for t in gguf.GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if len(parts) < 3 or not parts[2].endswith("_exps"):
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        stacked = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())
        prefix = f"model.layers.{parts[1]}.mlp.experts."
        if f"{prefix}gate_up_proj" in params:  # transformers 5 holds each projection's experts stacked
            if parts[2] == "ffn_down_exps":
                params[f"{prefix}down_proj"].data.copy_(stacked)
            else:
                half = stacked.shape[1]
                rows = slice(0, half) if parts[2] == "ffn_gate_exps" else slice(half, 2 * half)
                params[f"{prefix}gate_up_proj"].data[:, rows].copy_(stacked)
        else:
            raise AssertionError(f"unknown expert layout of {family} in transformers")
    return model


@pytest.mark.parametrize("quant", ["Q4_0", "MXFP4"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_quantized_experts_stay_quantized_and_match_their_dequantized_model(model, tmp_path, kernels, quant):
    family, hf_dir, _, ref = model
    path = write_gguf(hf_dir, tmp_path / "q.gguf", family, quant=getattr(gguf.GGMLQuantizationType, quant))
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers if hasattr(layer.mlp, "experts"))
    assert not isinstance(moe.experts[0].gate_up_weight, torch.Tensor)  # kept as its blocks
    deq = dequantized_reference(ref, path, family)
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    entry = out[0].outputs[0].logprobs[0]
    want, original = reference_logprobs(deq, prompt)[-1], reference_logprobs(ref, prompt)[-1]
    assert (want - original).abs().max() > 0.5  # the 4-bit model is another model
    for token, lp in entry.top_logprobs.items():
        assert lp == pytest.approx(float(want[token]), abs=1e-3), (token, lp, float(want[token]))
