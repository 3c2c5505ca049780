"""gpt-oss GGUF files (``general.architecture`` gpt-oss), written here as llama.cpp's converter
writes them from a HF checkpoint: gate and up de-interleaved into ffn_gate_exps / ffn_up_exps
[experts, inter, hidden] with their biases, down transposed into ffn_down_exps, the sinks as
attn_sinks.weight, the router as ffn_gate_inp with its bias, YaRN under rope.scaling.*; then
travelator on the file against transformers on the checkpoint (F32), and a file of MXFP4 experts
(gguf-py's quantizer, ggml's layout) against transformers holding the same dequantized experts.
llama.cpp truncates YaRN's correction range to whole pairs: the checkpoint here says so too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gguf_files import VOCAB, add_shape, add_vocab, finish
from hf_models import (assert_greedy_matches, build_checkpoint, gpt_oss_overrides, load_reference, randomize,
                       reference_logprobs)
from travelator import LLM, SamplingParams

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
PROMPTS = [[1, 7, 99, 250, 3, 18, 42], [1] + list(range(40, 90))]


def write_gguf(hf_dir: Path, out: Path, experts_type: gguf.GGMLQuantizationType | None = None) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    add_shape(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(VOCAB)
    add_vocab(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    for name, t in load_file(hf_dir / "model.safetensors").items():
        prefix, _, tail = name.rpartition(".experts.")
        layer = name.split(".")[2] if ".layers." in name else None
        if tail in ("gate_up_proj", "gate_up_proj_bias"):
            t = t.transpose(-1, -2) if tail == "gate_up_proj" else t  # [experts, 2 inter, hidden]
            for kind, half in (("ffn_gate_exps", t[:, 0::2]), ("ffn_up_exps", t[:, 1::2])):
                put(w, f"blk.{layer}.{kind}.{'bias' if tail.endswith('bias') else 'weight'}", half, experts_type)
        elif tail in ("down_proj", "down_proj_bias"):
            t = t.transpose(-1, -2) if tail == "down_proj" else t  # [experts, hidden, inter]
            put(w, f"blk.{layer}.ffn_down_exps.{'bias' if tail.endswith('bias') else 'weight'}", t, experts_type)
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            put(w, gguf_name + (".weight" if name.endswith("sinks") else ""), t, None)
    finish(w)
    return out


def put(w: gguf.GGUFWriter, name: str, t: torch.Tensor, qtype: gguf.GGMLQuantizationType | None) -> None:
    data = t.float().contiguous().numpy().astype(np.float32)
    if qtype is None or data.ndim < 3:
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf_dir = build_checkpoint(root / "hf", "gpt_oss", **dict(gpt_oss_overrides(), initializer_range=0.25,
                                                              intermediate_size=64, rope_parameters=YARN))
    randomize(hf_dir, ("bias", "sinks"), 0.5)
    return root, hf_dir, load_reference(hf_dir)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_travelator_on_the_gguf_matches_transformers(checkpoint, kernels):
    root, hf_dir, ref = checkpoint
    path = write_gguf(hf_dir, root / f"f32-{kernels}.gguf")
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    arch = llm.engine.arch
    assert (arch.family, arch.attention_sinks, arch.expert_bias, arch.output_bias) == ("gpt_oss", True, True, True)
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2
    assert_greedy_matches(llm, ref, PROMPTS, 10, 1e-4)


# torch: the kept 4-bit experts dequantized exactly; native: the integer kernel, whose integer
# form of x (quant_linear.cpp) is the difference.
@pytest.mark.parametrize("kernels,tolerance", [("torch", 1e-4), ("native", 3e-3)])
def test_mxfp4_experts_run_the_model_they_hold(checkpoint, kernels, tolerance):
    root, hf_dir, ref = checkpoint
    path = write_gguf(hf_dir, root / "mxfp4.gguf", gguf.GGMLQuantizationType.MXFP4)
    deq = copy.deepcopy(ref)
    experts = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2].endswith("_exps") and parts[3] == "weight":
            shape = tuple(int(x) for x in reversed(t.shape))
            experts[(int(parts[1]), parts[2])] = torch.from_numpy(
                gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())
    for i, layer in enumerate(deq.model.layers):
        gate, up = experts[(i, "ffn_gate_exps")], experts[(i, "ffn_up_exps")]
        gate_up = layer.mlp.experts.gate_up_proj.data  # [experts, hidden, 2 inter], interleaved
        gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
        layer.mlp.experts.down_proj.data.copy_(experts[(i, "ffn_down_exps")].transpose(1, 2))
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    assert llm.engine.runner.model.layers[0].mlp.experts[0].down_weight.codebook == "e2m1"  # kept 4-bit
    prompt = PROMPTS[1]
    entry = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    want, original = reference_logprobs(deq, prompt)[-1], reference_logprobs(ref, prompt)[-1]
    assert (want - original).abs().max() > 0.05  # the 4-bit experts make another model
    for token, lp in entry.top_logprobs.items():
        assert lp == pytest.approx(float(want[token]), abs=tolerance)
