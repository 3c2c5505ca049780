"""GGUF files of the Qwen2 and Qwen3 architectures (``general.architecture`` qwen2 / qwen3),
written here in llama.cpp's tensor names from a random-init HF checkpoint, against transformers.

The file is checked first: transformers' own GGUF loader reads it back into the same logits as
the HF checkpoint it came from, so a wrong name or layout in the writer fails there, not in
travelator. Then travelator, loading the GGUF, gives transformers' greedy tokens and logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import VOCAB, add_shape, add_tensors, add_vocab, finish
from hf_models import assert_greedy_matches, build_checkpoint, load_reference, randomize
from travelator import LLM

def write_gguf(hf_dir: Path, out: Path, arch: str) -> Path:
    """An F32 GGUF of the checkpoint, as llama.cpp's converter lays out Qwen2/Qwen3 (Q/K rows in
    HF's order: these architectures use NeoX rope), with a byte-fallback SentencePiece vocab."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    add_shape(w, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)  # Qwen3's head_dim is its own (128 by default here, not 64 / 4)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(VOCAB)
    add_vocab(w)
    model_arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    add_tensors(w, hf_dir, model_arch, cfg["num_hidden_layers"], shift_norms=False)
    finish(w)
    return out


CASES = {
    "qwen2": {},  # q/k/v biases
    "qwen3": {"tie_word_embeddings": True},  # q/k head norms, tied embeddings
}


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    hf_dir = build_checkpoint(root / "hf", arch, **CASES[arch])
    if arch == "qwen2":  # transformers initialises biases to zero: make them count
        randomize(hf_dir, (".bias",), 0.5)
    if arch == "qwen3":  # and the head norms to ones
        randomize(hf_dir, ("q_norm.weight", "k_norm.weight"), 0.5, offset=1.0)
    path = write_gguf(hf_dir, root / f"{arch}.gguf", arch)
    return arch, hf_dir, path, load_reference(hf_dir)


def test_the_written_file_is_what_transformers_reads_as_the_checkpoint(model):
    from transformers import AutoModelForCausalLM

    _, _, path, ref = model
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    tokens = torch.tensor([[1, 7, 99, 250, 3, 18, 42]])
    with torch.inference_mode():
        torch.testing.assert_close(from_gguf(tokens).logits, ref(tokens).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_travelator_on_the_gguf_matches_transformers(model, kernels):
    arch, _, path, ref = model
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=kernels)
    assert llm.engine.arch.family == arch
    assert llm.engine.arch.qk_norm == (arch == "qwen3")
    assert llm.engine.arch.attention_bias == (arch == "qwen2")
    assert_greedy_matches(llm, ref, [[1, 7, 99, 250, 3, 18, 42], [1] + list(range(40, 90))], 10, 2e-4)


def test_an_unknown_gguf_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish(w)
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'.*qwen3"):
        LLM(str(tmp_path / "x.gguf"))
