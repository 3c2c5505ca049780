"""GGUF files of Phi-3 and Gemma 3 (``general.architecture`` phi3 / gemma3), written here from a
random-init HF checkpoint as llama.cpp's convert_hf_to_gguf.py writes them, against transformers.

Phi3MiniModel: the fused attn_qkv and ffn_up (gate, then up) tensors whole and in HF's row order
(only llama's Q/K are permuted), LongRoPE as the tensors rope_factors_long / rope_factors_short
with rope.scaling.original_context_length and rope.scaling.attn_factor, partial rotary as
rope.dimension_count, no sliding window as 0. Gemma3Model: every ``*norm.weight`` written as
1 + w, the sandwich norms as attn_norm / post_attention_norm / ffn_norm / post_ffw_norm, the
global layers' rope as rope.freq_base and rope.scaling (linear), the sliding ones' as
rope.freq_base_swa, the window as attention.sliding_window and head_dim as key_length; no layer
pattern (llama.cpp takes every sixth layer as global) and no query_pre_attn_scalar (llama.cpp
scales by head_dim ** -0.5), so the Gemma checkpoint here has six layers and a
query_pre_attn_scalar of head_dim, as Gemma 3's own 1B to 12B sizes do. A second Gemma file
states its pattern (attention.sliding_window_pattern, one flag per layer), which llama.cpp reads.

The file is checked first: transformers' GGUF loader reads its tensors back into the same logits
as the HF checkpoint (given the checkpoint's config: transformers maps neither LongRoPE, partial
rotary, Gemma's rope scaling, local rope base nor the layer pattern from GGUF metadata), and
maps the metadata it does read to the checkpoint's values. Then travelator, loading the GGUF,
gives transformers' greedy tokens and logprobs on both kernel sets: prompts past Gemma's window
of 5, and Phi-3 in both LongRoPE regimes (short factors under a context within the pretraining
length, long ones past it; see test_phi3.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import VOCAB, add_shape, add_tensors, add_vocab, finish
from hf_models import (build_checkpoint, gemma3_overrides, load_reference, phi3_overrides, randomize,
                       reference_greedy, reference_logprobs)
from travelator import LLM, SamplingParams

ORIGINAL, MAXIMUM = 64, 256  # Phi-3's pretraining length and context


def write_phi3_gguf(hf_dir: Path, out: Path) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    longest, original = cfg["max_position_embeddings"], rope["original_max_position_embeddings"]
    w = gguf.GGUFWriter(str(out), "phi3")
    add_shape(w, cfg)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    scale = longest / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_vocab_size(VOCAB)
    add_vocab(w)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_tensors(w, hf_dir, gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"], shift_norms=False)
    finish(w)
    return out


def write_gemma3_gguf(hf_dir: Path, out: Path, pattern: bool = False) -> Path:
    """``pattern``: also state which layers slide (attention.sliding_window_pattern, one flag each)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    full, local = rope["full_attention"], rope["sliding_attention"]
    w = gguf.GGUFWriter(str(out), "gemma3")
    add_shape(w, cfg)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if pattern:
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg["layer_types"]])
    add_vocab(w)
    add_tensors(w, hf_dir, gguf.MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"], shift_norms=True)
    finish(w)
    return out


def gemma3_config(**overrides) -> dict:
    # query_pre_attn_scalar = head_dim: a GGUF file carries none (see the module's docstring). The
    # sliding layers' rope base is not llama.cpp's default of 10000, so that the file's must count.
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}}
    return gemma3_overrides(window=5) | {"query_pre_attn_scalar": 32, "rope_parameters": rope} | overrides


CASES = {
    "phi3": ("phi3", phi3_overrides(original=ORIGINAL, maximum=MAXIMUM), write_phi3_gguf),
    # Six layers without layer_types: every sixth is global, as llama.cpp reads a Gemma 3 file.
    "gemma3": ("gemma3", gemma3_config(num_hidden_layers=6, layer_types=None), write_gemma3_gguf),
    # hf_models' three layers (sliding, global, sliding), named in the file.
    "gemma3_pattern": ("gemma3", gemma3_config(), lambda hf, out: write_gemma3_gguf(hf, out, pattern=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    family, overrides, write = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = build_checkpoint(root / "hf", family, **overrides)
    # transformers initialises norms to constants, which hide a swapped or unshifted norm.
    if family == "gemma3":
        randomize(hf_dir, ("norm.weight",), 0.5)  # unit offset: scales of 0.5 to 1.5
    else:
        randomize(hf_dir, ("norm.weight",), 0.5, offset=1.0)
    path = write(hf_dir, root / f"{request.param}.gguf")
    return request.param, hf_dir, path, load_reference(hf_dir)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, VOCAB) for _ in range(length - 1)]


def test_the_written_file_is_what_transformers_reads_as_the_checkpoint(model):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, hf_dir, path, ref = model
    config = AutoConfig.from_pretrained(hf_dir)
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    tokens = torch.tensor([prompt_of(90, 0)])  # past Phi-3's pretraining length and Gemma's window
    with torch.inference_mode():
        torch.testing.assert_close(from_gguf(tokens).logits, ref(tokens).logits, atol=1e-4, rtol=1e-4)
    # The metadata transformers maps from the file is the checkpoint's.
    read = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "vocab_size"):
        assert getattr(read, key) == pytest.approx(getattr(config, key)), key
    if config.model_type == "gemma3_text":
        assert (read.head_dim, read.sliding_window) == (config.head_dim, config.sliding_window)
        assert read.rope_parameters["full_attention"]["rope_theta"] == config.rope_parameters["full_attention"][
            "rope_theta"]


def test_the_arch_read_from_the_gguf_is_the_checkpoints(model):
    """Beside what transformers reads: travelator's shape of the model from the file equals the one
    it reads from the HF checkpoint (LongRoPE factors to float32, in which the file holds them)."""
    from travelator.model.loader import open_model

    _, hf_dir, path, _ = model
    want, got = open_model(str(hf_dir)).arch, open_model(str(path)).arch
    for key in ("family", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "sliding_window",
                "layer_types", "qk_norm", "rotary_dim", "hidden_act", "norm_unit_offset", "embed_scale",
                "local_rope_theta", "final_logit_softcapping"):
        assert getattr(got, key) == getattr(want, key), key
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert got.attention_scale == pytest.approx(want.attention_scale)
    if want.rope_scaling is None:
        assert got.rope_scaling is None
    elif want.rope_scaling["rope_type"] == "linear":
        assert got.rope_scaling == {"rope_type": "linear", "factor": want.rope_scaling["factor"]}
    else:
        for key in ("long_factor", "short_factor"):
            assert got.rope_scaling[key] == pytest.approx(want.rope_scaling[key], rel=1e-6), key
        for key in ("rope_type", "original_max_position_embeddings", "max_position_embeddings"):
            assert got.rope_scaling[key] == want.rope_scaling[key], key


def runs(name: str) -> list[tuple[str, dict, list[list[int]]]]:
    """(label, engine arguments, prompts) of the runs to compare."""
    if name == "phi3":
        return [
            # A context within the pretraining length: short factors, sequences within it.
            ("short", {"max_model_len": ORIGINAL}, [prompt_of(n, n) for n in (5, 20, 40)]),
            # The default context (256 > 64): long factors, prompts already past the pretraining length.
            ("long", {"max_num_batched_tokens": 48}, [prompt_of(n, n) for n in (65, 90, 150)]),
        ]
    return [("windowed", {}, [prompt_of(n, n) for n in (7, 30, 51)])]  # all past the window of 5


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_travelator_on_the_gguf_matches_transformers(model, kernels):
    name, _, path, ref = model
    new = 16
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=1)
    for label, engine_args, prompts in runs(name):
        llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels, **engine_args)
        assert llm.engine.arch.family == name.split("_")[0]
        for prompt, result in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            out = result.outputs[0]
            assert out.token_ids == reference_greedy(ref, prompt, new), (label, len(prompt))
            want = reference_logprobs(ref, prompt + out.token_ids)
            for i, lp in enumerate(out.logprobs):
                assert lp.logprob == pytest.approx(float(want[len(prompt) - 1 + i][lp.token_id]), abs=2e-4), (
                    label, len(prompt), i)
