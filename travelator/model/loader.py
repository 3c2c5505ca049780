"""Find a model's shape, weights and tokenizer from what the user points at:
a HF-layout directory (config.json, *.safetensors, tokenizer files), a GGUF file of
an architecture in ``arch.GGUF_ARCHITECTURES``, or ``dummy:<preset>`` (random weights of a
built-in shape).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from travelator.model.arch import GGUF_ARCHITECTURES, QK_NORM_FAMILIES, ModelArch, preset, unsupported_architecture
from travelator.model.quant import BlockQuantized, parse_gguf_blocks
from travelator.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

WeightIterator = Callable[[], Iterator[tuple[str, torch.Tensor]]]

DUMMY_PREFIX = "dummy:"


@dataclass(slots=True)
class ModelSource:
    name: str
    arch: ModelArch
    tokenizer: Tokenizer
    weights: WeightIterator | None  # None: random weights
    checkpoint_dtype: str | None = None  # what the weights are stored in, if known


def open_model(model: str, load_format: str = "auto") -> ModelSource:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model.startswith(DUMMY_PREFIX):
        arch = preset(model[len(DUMMY_PREFIX):])
        return ModelSource(model, arch, Tokenizer.byte_level(arch.vocab_size), None)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give a HF-layout directory, a .gguf file, "
            f"or dummy:<preset>"
        )
    if path.is_dir():
        source = _open_hf_dir(path)
    elif path.suffix == ".gguf":
        source = _open_gguf(path)
    else:
        raise ValueError(f"model {model!r} is neither a directory nor a .gguf file")
    if load_format == "dummy":
        source.weights = None
    return source


# ---- Hugging Face layout -----------------------------------------------------------
def _open_hf_dir(path: Path) -> ModelSource:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    arch = ModelArch.from_hf_config(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    if (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_pretrained_dir(path)
    else:
        # Token-id prompts still work; text is rendered byte-wise.
        logger.warning("%s has no tokenizer.json: using a byte-level tokenizer", path)
        tokenizer = Tokenizer.byte_level(arch.vocab_size)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelSource(str(path), arch, tokenizer, lambda: _iter_safetensors(files), dtype)


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"could not read weights file {f}: {e}") from None


# ---- GGUF ----------------------------------------------------------------------------
_GGUF_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _open_gguf(path: Path) -> ModelSource:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise ValueError(f"could not read GGUF file {path}: {e}") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    name = field("general.architecture")
    family = GGUF_ARCHITECTURES.get(name)
    if family is None:
        raise unsupported_architecture(name)

    def arch_field(key: str, default=None):  # "llama.block_count", "qwen3.block_count", ...
        return field(f"{name}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    n_heads = int(arch_field("attention.head_count"))
    hidden = int(arch_field("embedding_length"))
    tokenizer = Tokenizer.from_gguf(reader)
    arch = ModelArch(
        family=family,
        vocab_size=int(arch_field("vocab_size", tokenizer.vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(arch_field("feed_forward_length")),
        num_layers=int(arch_field("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(arch_field("attention.head_count_kv", n_heads)),
        head_dim=int(arch_field("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(arch_field("rope.freq_base", 10000.0)),
        max_position_embeddings=int(arch_field("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=family in QK_NORM_FAMILIES,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    all_f32 = all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    dtype = "float32" if all_f32 else None
    return ModelSource(str(path), arch, tokenizer, lambda: _iter_gguf(reader, arch), dtype)


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """A llama GGUF's Q/K rows rotate adjacent pairs (llama.cpp's converter permutes them);
    put them back in the rotate-halves layout. Qwen2/Qwen3 files keep HF's layout."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf(reader, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """The file's tensors under HF names, as float32 tensors; a linear layer's Q8_0, Q6_K,
    Q4_0, Q4_1 or Q4_K tensor as its blocks (``BlockQuantized``), for the model to keep
    quantized or to dequantize (``LlamaModel.load_weights``). Other quantized types are
    dequantized here."""
    import gguf

    permuted = arch.family == "llama"  # see _unpermute_rope

    kinds = gguf.GGMLQuantizationType
    kept = {kinds.Q8_0: "q8_0", kinds.Q6_K: "q6_k", kinds.Q4_0: "q4_0", kinds.Q4_1: "q4_1", kinds.Q4_K: "q4_k"}
    warned: set[str] = set()
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne order is reversed
        parts = t.name.split(".")
        linear = parts[0] == "blk" and len(parts) > 3 and parts[2] in _GGUF_LINEAR and parts[3] == "weight"
        if linear and t.tensor_type in kept:
            blocks = parse_gguf_blocks(t.data, kept[t.tensor_type], *shape)
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
            if permuted and parts[2] in ("attn_q", "attn_k"):
                heads = arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads
                order = _unpermute_rope(np.arange(shape[0])[:, None], heads)[:, 0]
                blocks = blocks.rows(torch.from_numpy(order.copy()))
            yield name, blocks
            continue
        data = t.data
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            if linear and t.tensor_type.name not in warned:
                warned.add(t.tensor_type.name)
                logger.warning("GGUF %s tensors (like %s) are dequantized at load: only Q8_0, Q6_K, Q4_0, "
                               "Q4_1 and Q4_K stay quantized", t.tensor_type.name, t.name)
            data = gguf.quants.dequantize(data, t.tensor_type)
        arr = np.asarray(data, dtype=np.float32).reshape(shape)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if permuted and parts[2] == "attn_q":
                arr = _unpermute_rope(arr, arch.num_heads)
            elif permuted and parts[2] == "attn_k":
                arr = _unpermute_rope(arr, arch.num_kv_heads)
        elif t.name == "rope_freqs.weight":
            raise ValueError("GGUF files with rope_freqs tensors are not supported")
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # copy out of the mmap
