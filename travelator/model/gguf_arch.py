"""A model's shape (ModelArch) from a GGUF file's metadata and tensor names, as llama.cpp reads
each architecture: its keys under the architecture's name ("llama.block_count"), typed and
range-checked by GgufMetadata."""

from __future__ import annotations

import numpy as np

from travelator.model.arch import GEMMA3_FEATURES, QK_NORM_FAMILIES, ModelArch
from travelator.model.arch_check import MAX_CONTEXT, MAX_LAYERS
from travelator.model.gguf_metadata import GgufMetadata
from travelator.model.model_file_error import ModelFileError
from travelator.model.tokenizer import Tokenizer

GGUF_ROUTER = "ffn_gate_inp"  # a layer's router tensor: a layer without one keeps a dense MLP
_GGUF_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid
_GEMMA3_SWA_PERIOD = 6  # llama.cpp's Gemma 3 default: every sixth layer is global
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's Gemma 3 default when the file names none


def gguf_arch(family: str, keys: GgufMetadata, tensors: dict, tokenizer: Tokenizer) -> ModelArch:
    """The model's shape from its GGUF metadata (``keys``: those under the architecture's name),
    its tensor names and its tokenizer's special ids."""
    n_heads = keys.int("attention.head_count")
    hidden = keys.int("embedding_length")
    head_dim = keys.int("attention.key_length", hidden // n_heads)
    rotary = keys.int("rope.dimension_count", None)
    fields = dict(
        family=family,
        vocab_size=keys.int("vocab_size", tokenizer.vocab_size),
        hidden_size=hidden,
        intermediate_size=keys.int("feed_forward_length", low=0),
        num_layers=keys.int("block_count", high=MAX_LAYERS),
        num_heads=n_heads,
        num_kv_heads=keys.int("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rms_norm_eps=keys.float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=keys.float("rope.freq_base", 10000.0),
        max_position_embeddings=keys.int("context_length", 2048, high=MAX_CONTEXT),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=family in QK_NORM_FAMILIES,
        # Partial rotary (Phi-4-mini): rope turns the first rope.dimension_count numbers of a head.
        rotary_dim=rotary if rotary is not None and rotary != head_dim else None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    if keys.int("expert_count", 0, low=0):
        fields |= _gguf_experts(family, keys, tensors, fields["num_layers"])
    if family == "gpt_oss":
        fields |= _gguf_gpt_oss(keys, tensors, fields["num_layers"])
    if family == "phi3":
        fields |= _gguf_phi3(keys, tensors)
    elif family == "gemma3":
        fields |= _gguf_gemma3(keys, fields)
    return ModelArch(**fields)


def _gguf_experts(family: str, keys: GgufMetadata, tensors: dict, layers: int) -> dict:
    """A mixture of experts as llama.cpp reads it: a llama file with experts is Mixtral; the
    experts' width is expert_feed_forward_length (Mixtral's: feed_forward_length); the top-k is
    renormalised unless expert_weights_norm says otherwise (llama.cpp renormalises both
    families'); a layer without a router keeps a dense MLP."""
    if family not in ("llama", "qwen3_moe", "gpt_oss"):
        raise ValueError(f"{family} GGUF files with experts are not supported")
    if keys.int("expert_shared_count", 0, low=0):
        raise ValueError("shared experts are not supported")
    if keys.int("expert_gating_func", _GGUF_SOFTMAX_GATING, low=0) != _GGUF_SOFTMAX_GATING:
        raise ValueError("only softmax expert gating is supported")
    width = keys.int("expert_feed_forward_length", 0, low=0) or keys.int("feed_forward_length")
    return dict(
        family="mixtral" if family == "llama" else family,
        num_experts=keys.int("expert_count"),
        experts_per_token=keys.int("expert_used_count"),
        expert_intermediate_size=width,
        norm_topk_prob=bool(keys.value("expert_weights_norm", True)),
        dense_layers=tuple(i for i in range(layers) if f"blk.{i}.{GGUF_ROUTER}.weight" not in tensors),
    )


_GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss: the file carries neither limit nor alpha


def _gguf_gpt_oss(keys: GgufMetadata, tensors: dict, layers: int) -> dict:
    """gpt-oss as llama.cpp reads it: every other layer slides (the even ones) over
    attention.sliding_window keys, sinks, biases, the clamped SwiGLU, and YaRN from
    rope.scaling.*, whose correction range llama.cpp truncates to whole pairs."""
    window = keys.int("attention.sliding_window", high=MAX_CONTEXT)
    kind = keys.str("rope.scaling.type", "none")
    if kind not in ("none", "yarn"):
        raise ValueError(f"gpt-oss: rope scaling {kind!r} is not supported (supported: yarn)")
    scaling = None
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": keys.float("rope.scaling.factor"), "truncate": True,
                   "original_max_position_embeddings": keys.int("rope.scaling.original_context_length",
                                                                high=MAX_CONTEXT)}
    return dict(
        sliding_window=window, layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                                 for i in range(layers)),
        output_bias="blk.0.attn_output.bias" in tensors, attention_sinks=True, expert_bias=True,
        swiglu_limit=_GPT_OSS_SWIGLU_LIMIT, rope_scaling=scaling,
    )


def _gguf_phi3(keys: GgufMetadata, tensors) -> dict:
    """Phi-3's LongRoPE, as llama.cpp's converter writes it: the long and short factors as the
    tensors rope_factors_long / rope_factors_short (one per rotary pair), the pretraining length
    as rope.scaling.original_context_length and the attention factor as rope.scaling.attn_factor
    (files without factors turn plainly). The sliding window (0: none) is kept as the HF config's
    is (llama.cpp ignores Phi-3's window; transformers applies it)."""
    window = keys.int("attention.sliding_window", 0, low=0, high=MAX_CONTEXT) or None
    if "rope_factors_long.weight" not in tensors:
        return {"sliding_window": window}

    def factors(name: str) -> list[float]:
        if name not in tensors:
            raise ModelFileError(keys.path, f"tensor {name}", "is missing (rope_factors_long.weight is there)")
        return [float(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]

    scaling = {
        "rope_type": "longrope",
        "long_factor": factors("rope_factors_long.weight"),
        "short_factor": factors("rope_factors_short.weight"),
        # llama.cpp's default: the context length (no extension)
        "original_max_position_embeddings": keys.int("rope.scaling.original_context_length",
                                                     keys.int("context_length", high=MAX_CONTEXT),
                                                     high=MAX_CONTEXT),
        "max_position_embeddings": keys.int("context_length", high=MAX_CONTEXT),
    }
    attn_factor = keys.float("rope.scaling.attn_factor", None)
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    return {"rope_scaling": scaling, "sliding_window": window}


def _gguf_gemma3(keys: GgufMetadata, fields: dict) -> dict:
    """Gemma 3 as llama.cpp reads it. A window (attention.sliding_window > 0) makes every layer
    slide but every sixth, or those attention.sliding_window_pattern names (a period, or a flag
    per layer); sliding layers turn by rope.freq_base_swa (10000 without it), unscaled, the global
    ones by rope.freq_base with rope.scaling (linear). The file carries no query_pre_attn_scalar:
    llama.cpp scales scores by head_dim ** -0.5, and by (hidden / heads) ** -0.5 for the 62 layers
    of the 27B (whose query_pre_attn_scalar is that), and so does this."""
    layers, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    window = keys.int("attention.sliding_window", 0, low=0, high=MAX_CONTEXT) or None
    pattern = keys.value("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern]
        if len(slides) != layers:
            raise ValueError(f"gemma3: sliding_window_pattern has {len(slides)} flags for {layers} layers")
    else:  # a period: every period-th layer is global (0: none is)
        period = keys.int("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD, low=0, high=MAX_LAYERS)
        slides = [period == 0 or i % period < period - 1 for i in range(layers)]
    kind = keys.str("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"gemma3: rope scaling {kind!r} is not supported (supported: linear)")
    factor = keys.float("rope.scaling.factor", 1.0)
    cap = keys.float("final_logit_softcapping", None)
    scalar = hidden // heads if layers == 62 else fields["head_dim"]
    return dict(
        rope_scaling={"rope_type": "linear", "factor": factor} if kind == "linear" and factor != 1.0 else None,
        sliding_window=window,
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in slides),
        local_rope_theta=keys.float("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE),
        **GEMMA3_FEATURES,
        attention_scale=scalar ** -0.5,
        final_logit_softcapping=cap or None,
    )
