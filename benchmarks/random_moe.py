"""A random-init Qwen3-MoE of the ``qwen3-moe-1b`` preset's shape (travelator/model/arch.py:
~0.9B parameters, ~0.2B active), as a HF directory in bfloat16 (transformers' own init, seed 0)
and as a BF16 GGUF of the same weights laid out as llama.cpp's converter lays out qwen3moe
(each projection's experts stacked, the router as ffn_gate_inp, 1-D tensors in F32), with the
synthetic SentencePiece vocabulary of ../shared/peers/hf_to_gguf.py: what benchmarks/vs_peers.py
gives every system for ``--preset qwen3-moe-1b``.

    python benchmarks/random_moe.py HF_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from travelator.model.arch import preset

PRESET = "qwen3-moe-1b"


def hf_config(name: str = PRESET) -> dict:
    a = preset(name)
    return dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                head_dim=a.head_dim, num_experts=a.num_experts, num_experts_per_tok=a.experts_per_token,
                moe_intermediate_size=a.expert_intermediate_size, norm_topk_prob=a.norm_topk_prob,
                max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps,
                rope_theta=a.rope_theta, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                mlp_only_layers=[], decoder_sparse_step=1)


def write_hf(out: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config()))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def write_gguf(hf_dir: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers writes the latter
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _add_vocab(w, cfg["vocab_size"])

    def put(name: str, t: torch.Tensor) -> None:
        if t.ndim == 1:
            w.add_tensor(name, t.float().numpy())
        else:
            raw = t.contiguous().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, raw, raw_shape=list(t.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg["num_hidden_layers"])
    for name, t in weights.items():
        if ".experts." not in name:
            put(names.get_name(name, try_suffixes=(".weight", ".bias")), t)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        for proj, kind in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            put(f"blk.{layer}.{kind}.weight",
                torch.stack([weights[f"{p}.{e}.{proj}.weight"] for e in range(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_vocab(w, size: int) -> None:
    """../shared/peers/hf_to_gguf.py's vocabulary: <unk>, <s>, </s>, 256 bytes, then filler pieces."""
    import gguf

    kinds = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [kinds.UNKNOWN, kinds.CONTROL, kinds.CONTROL] + [kinds.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types += [kinds.NORMAL] * (size - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(size - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("gguf")
    args = ap.parse_args()
    write_hf(Path(args.hf_dir))
    write_gguf(Path(args.hf_dir), Path(args.gguf))
    print("wrote", args.hf_dir, "and", args.gguf)


if __name__ == "__main__":
    main()
