"""Find a model's shape, weights and tokenizer from what the user points at:
a HF-layout directory (config.json, *.safetensors, tokenizer files), a GGUF file of
an architecture in ``arch.GGUF_ARCHITECTURES`` (llama.cpp's tensor names and metadata keys, as
its convert_hf_to_gguf.py writes them), or ``dummy:<preset>`` (random weights of a
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

from travelator.model.arch import (GEMMA3_FEATURES, GGUF_ARCHITECTURES, QK_NORM_FAMILIES, ModelArch, preset,
                                   unsupported_architecture)
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
_GGUF_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# A mixture's experts, stacked in one tensor per projection [experts, out, in]: HF's name of
# each expert's piece ({e}: the expert), and the router.
_GGUF_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_GGUF_ROUTER = "ffn_gate_inp"
_GGUF_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid
# llama.cpp's names of a layer's tensors -> HF's (without "model.layers.N."), in every family
# but where _GGUF_FAMILY_NAMES says otherwise.
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    _GGUF_ROUTER: "mlp.gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_FAMILY_NAMES = {
    # Phi-3: the checkpoint's fused tensors, whole (ffn_up holds gate, then up: 2 x n_ff rows).
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: the MLP's input norm, and the sinks (written as a "weight").
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    # Gemma 3's sandwich norms: ffn_norm is the MLP's input norm here, not the one after attention.
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# Model-level tensors read into ModelArch, not loaded as weights (Phi-3's LongRoPE factors).
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GEMMA3_SWA_PERIOD = 6  # llama.cpp's Gemma 3 default: every sixth layer is global
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's Gemma 3 default when the file names none


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

    tensors = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf(reader)
    arch = _gguf_arch(family, arch_field, tensors, tokenizer)
    all_f32 = all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    dtype = "float32" if all_f32 else None
    return ModelSource(str(path), arch, tokenizer, lambda: _iter_gguf(reader, arch), dtype)


def _gguf_arch(family: str, arch_field, tensors: dict, tokenizer: Tokenizer) -> ModelArch:
    """The model's shape from its GGUF metadata (``arch_field``: a key under the architecture's
    name), its tensor names and its tokenizer's special ids."""
    n_heads = int(arch_field("attention.head_count"))
    hidden = int(arch_field("embedding_length"))
    head_dim = int(arch_field("attention.key_length", hidden // n_heads))
    rotary = arch_field("rope.dimension_count")
    fields = dict(
        family=family,
        vocab_size=int(arch_field("vocab_size", tokenizer.vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(arch_field("feed_forward_length")),
        num_layers=int(arch_field("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(arch_field("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(arch_field("rope.freq_base", 10000.0)),
        max_position_embeddings=int(arch_field("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=family in QK_NORM_FAMILIES,
        # Partial rotary (Phi-4-mini): rope turns the first rope.dimension_count numbers of a head.
        rotary_dim=int(rotary) if rotary is not None and int(rotary) != head_dim else None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    if arch_field("expert_count"):
        fields |= _gguf_experts(family, arch_field, tensors, fields["num_layers"])
    if family == "gpt_oss":
        fields |= _gguf_gpt_oss(arch_field, tensors, fields["num_layers"])
    if family == "phi3":
        fields |= _gguf_phi3(arch_field, tensors)
    elif family == "gemma3":
        fields |= _gguf_gemma3(arch_field, fields)
    return ModelArch(**fields)


def _gguf_experts(family: str, arch_field, tensors: dict, layers: int) -> dict:
    """A mixture of experts as llama.cpp reads it: a llama file with experts is Mixtral; the
    experts' width is expert_feed_forward_length (Mixtral's: feed_forward_length); the top-k is
    renormalised unless expert_weights_norm says otherwise (llama.cpp renormalises both
    families'); a layer without a router keeps a dense MLP."""
    if family not in ("llama", "qwen3_moe", "gpt_oss"):
        raise ValueError(f"{family} GGUF files with experts are not supported")
    if int(arch_field("expert_shared_count", 0)):
        raise ValueError("shared experts are not supported")
    if int(arch_field("expert_gating_func", _GGUF_SOFTMAX_GATING)) != _GGUF_SOFTMAX_GATING:
        raise ValueError("only softmax expert gating is supported")
    width = arch_field("expert_feed_forward_length") or arch_field("feed_forward_length")
    return dict(
        family="mixtral" if family == "llama" else family,
        num_experts=int(arch_field("expert_count")),
        experts_per_token=int(arch_field("expert_used_count")),
        expert_intermediate_size=int(width),
        norm_topk_prob=bool(arch_field("expert_weights_norm", True)),
        dense_layers=tuple(i for i in range(layers) if f"blk.{i}.{_GGUF_ROUTER}.weight" not in tensors),
    )


_GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss: the file carries neither limit nor alpha


def _gguf_gpt_oss(arch_field, tensors: dict, layers: int) -> dict:
    """gpt-oss as llama.cpp reads it: every other layer slides (the even ones) over
    attention.sliding_window keys, sinks, biases, the clamped SwiGLU, and YaRN from
    rope.scaling.*, whose correction range llama.cpp truncates to whole pairs."""
    window = int(arch_field("attention.sliding_window"))
    kind = arch_field("rope.scaling.type", "none")
    if kind not in ("none", "yarn"):
        raise ValueError(f"gpt-oss: rope scaling {kind!r} is not supported (supported: yarn)")
    scaling = None
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(arch_field("rope.scaling.factor")), "truncate": True,
                   "original_max_position_embeddings": int(arch_field("rope.scaling.original_context_length"))}
    return dict(
        sliding_window=window, layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                                 for i in range(layers)),
        output_bias="blk.0.attn_output.bias" in tensors, attention_sinks=True, expert_bias=True,
        swiglu_limit=_GPT_OSS_SWIGLU_LIMIT, rope_scaling=scaling,
    )


def _gguf_phi3(arch_field, tensors) -> dict:
    """Phi-3's LongRoPE, as llama.cpp's converter writes it: the long and short factors as the
    tensors rope_factors_long / rope_factors_short (one per rotary pair), the pretraining length
    as rope.scaling.original_context_length and the attention factor as rope.scaling.attn_factor
    (files without factors turn plainly). The sliding window (0: none) is kept as the HF config's
    is (llama.cpp ignores Phi-3's window; transformers applies it)."""
    window = int(arch_field("attention.sliding_window", 0)) or None
    if "rope_factors_long.weight" not in tensors:
        return {"sliding_window": window}

    def factors(name: str) -> list[float]:
        return [float(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]

    scaling = {
        "rope_type": "longrope",
        "long_factor": factors("rope_factors_long.weight"),
        "short_factor": factors("rope_factors_short.weight"),
        # llama.cpp's default: the context length (no extension)
        "original_max_position_embeddings": int(arch_field("rope.scaling.original_context_length",
                                                           arch_field("context_length"))),
        "max_position_embeddings": int(arch_field("context_length")),
    }
    attn_factor = arch_field("rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return {"rope_scaling": scaling, "sliding_window": window}


def _gguf_gemma3(arch_field, fields: dict) -> dict:
    """Gemma 3 as llama.cpp reads it. A window (attention.sliding_window > 0) makes every layer
    slide but every sixth, or those attention.sliding_window_pattern names (a period, or a flag
    per layer); sliding layers turn by rope.freq_base_swa (10000 without it), unscaled, the global
    ones by rope.freq_base with rope.scaling (linear). The file carries no query_pre_attn_scalar:
    llama.cpp scales scores by head_dim ** -0.5, and by (hidden / heads) ** -0.5 for the 62 layers
    of the 27B (whose query_pre_attn_scalar is that), and so does this."""
    layers, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    window = int(arch_field("attention.sliding_window", 0)) or None
    pattern = arch_field("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern]
        if len(slides) != layers:
            raise ValueError(f"gemma3: sliding_window_pattern has {len(slides)} flags for {layers} layers")
    else:  # a period: every period-th layer is global (0: none is)
        period = int(pattern)
        slides = [period == 0 or i % period < period - 1 for i in range(layers)]
    kind = arch_field("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"gemma3: rope scaling {kind!r} is not supported (supported: linear)")
    factor = float(arch_field("rope.scaling.factor", 1.0))
    cap = arch_field("final_logit_softcapping")
    scalar = hidden // heads if layers == 62 else fields["head_dim"]
    return dict(
        rope_scaling={"rope_type": "linear", "factor": factor} if kind == "linear" and factor != 1.0 else None,
        sliding_window=window,
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in slides),
        local_rope_theta=float(arch_field("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        **GEMMA3_FEATURES,
        attention_scale=scalar ** -0.5,
        final_logit_softcapping=float(cap) if cap else None,
    )


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """A llama GGUF's Q/K rows rotate adjacent pairs (llama.cpp's converter permutes them);
    put them back in the rotate-halves layout. Qwen2/Qwen3 files keep HF's layout."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF names of the tensors outside the blocks, and their HF names.
_GGUF_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def _gguf_float_name(gguf_name: str, names: dict[str, str]) -> str:
    """The HF name of a GGUF tensor loaded as floats (``names``: block tensor names)."""
    if gguf_name in _GGUF_TOP_LEVEL:
        return _GGUF_TOP_LEVEL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF files with rope_freqs tensors are not supported")
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _iter_gguf(reader, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """The file's tensors under HF names, as float32 tensors; a linear layer's Q8_0, Q6_K,
    Q4_0, Q4_1, Q4_K or MXFP4 tensor as its blocks (``BlockQuantized``), for the model to keep
    quantized or to dequantize (``LlamaModel.load_weights``). Other quantized types are
    dequantized here."""
    import gguf

    permuted = arch.family in ("llama", "mixtral")  # see _unpermute_rope
    names = _GGUF_NAMES | _GGUF_FAMILY_NAMES.get(arch.family, {})
    # llama.cpp's converter writes Gemma's norm weights w as 1 + w (llama.cpp scales by the weight
    # as it is); travelator's Gemma norms scale by 1 + w, as the HF checkpoint's: take the 1 back.
    norm_offset = 1.0 if arch.norm_unit_offset else 0.0

    kinds = gguf.GGMLQuantizationType
    kept = {kinds.Q8_0: "q8_0", kinds.Q6_K: "q6_k", kinds.Q4_0: "q4_0", kinds.Q4_1: "q4_1", kinds.Q4_K: "q4_k",
            kinds.MXFP4: "mxfp4"}
    warned: set[str] = set()
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_FACTORS:
            continue  # in arch.rope_scaling already
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne order is reversed
        parts = t.name.split(".")
        linear = parts[0] == "blk" and len(parts) > 3 and parts[2] in _GGUF_LINEAR and parts[3] == "weight"
        if parts[0] == "blk" and len(parts) > 3 and parts[2] in _GGUF_EXPERTS:  # gpt-oss's biases too
            yield from _gguf_experts_of(t, shape, int(parts[1]), _GGUF_EXPERTS[parts[2]] + "." + parts[3], kept, warned)
            continue
        if linear and t.tensor_type in kept:
            blocks = parse_gguf_blocks(t.data, kept[t.tensor_type], *shape)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
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
                               "Q4_1, Q4_K and MXFP4 stay quantized", t.tensor_type.name, t.name)
            data = gguf.quants.dequantize(data, t.tensor_type)
        arr = np.asarray(data, dtype=np.float32).reshape(shape)
        name = _gguf_float_name(t.name, names)
        if permuted and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            arr = _unpermute_rope(arr, arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads)
        if norm_offset and t.name.endswith("norm.weight"):
            arr = arr - norm_offset
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # copy out of the mmap


def _gguf_experts_of(t, shape: tuple[int, ...], layer: int, name: str, kept: dict,
                     warned: set[str]) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """A stacked expert tensor [experts, out, in] (or its bias [experts, out]), expert by expert
    under HF's names (``name``: with "{e}" for the expert): a kept quantized type as its blocks,
    anything else as float32."""
    import gguf

    if t.tensor_type in kept:
        experts, rows, cols = shape
        blocks = parse_gguf_blocks(np.asarray(t.data).reshape(experts * rows, -1), kept[t.tensor_type],
                                   experts * rows, cols)
        for e in range(experts):
            yield f"model.layers.{layer}.{name.format(e=e)}", blocks.rows(slice(e * rows, (e + 1) * rows))
        return
    data = t.data
    if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        if t.tensor_type.name not in warned:
            warned.add(t.tensor_type.name)
            logger.warning("GGUF %s tensors (like %s) are dequantized at load: only Q8_0, Q6_K, Q4_0, "
                           "Q4_1, Q4_K and MXFP4 stay quantized", t.tensor_type.name, t.name)
        data = gguf.quants.dequantize(data, t.tensor_type)
    arr = np.asarray(data, dtype=np.float32).reshape(shape)
    for e in range(shape[0]):
        yield f"model.layers.{layer}.{name.format(e=e)}", torch.from_numpy(np.array(arr[e]))
