"""GGUF files written in tests as llama.cpp's converter writes them: a small byte-fallback
vocabulary, a checkpoint's tensors under llama.cpp's names (gguf-py's map), the file closed."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

VOCAB = 300  # hf_models' checkpoints


def add_shape(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The sizes every architecture's file states, from a HF config."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])


def add_vocab(w: gguf.GGUFWriter) -> None:
    """A byte-fallback SentencePiece vocabulary of VOCAB tokens (the prompts here are token ids)."""
    kinds = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(VOCAB - len(tokens))]
    types = [kinds.UNKNOWN, kinds.CONTROL, kinds.CONTROL] + [kinds.BYTE] * 256
    types += [kinds.NORMAL] * (VOCAB - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def add_tensors(w: gguf.GGUFWriter, hf_dir: Path, arch: gguf.MODEL_ARCH, layers: int, shift_norms: bool) -> None:
    """The checkpoint's tensors under llama.cpp's names (gguf-py's map, which the converter uses),
    in float32; Gemma's norms as 1 + w."""
    names = gguf.get_tensor_name_map(arch, layers)
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = tensor.float()
        if shift_norms and name.endswith("norm.weight"):
            data = data + 1
        w.add_tensor(gguf_name, data.numpy().astype(np.float32))


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
