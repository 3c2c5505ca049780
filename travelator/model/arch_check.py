"""Checks of a model's shape as a file states it, before anything is built from it: a HF
config's values have the types and ranges ModelArch.from_hf_config reads them as, and the
model they describe is no larger than the file's weights can hold, so a damaged value is a
ModelFileError naming the key instead of an exception from arithmetic or an allocation of
whatever size it happens to say."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from travelator.model.arch import ModelArch
from travelator.model.model_file_error import ModelFileError, shown

MAX_SIZE = 2**31  # a width, a vocabulary, a count of heads or experts
MAX_LAYERS = 2**16  # loops over the layers run before any weight is read
MAX_CONTEXT = 2**24  # the rope tables hold a row per position
# The fewest bits a weight takes in a file (llama.cpp's smallest types take 1.56): a model
# needing more parameters than the file's bytes hold at this rate is not in that file.
_MIN_BITS_PER_WEIGHT = 1

_POSITIVE_INTS = {"vocab_size": MAX_SIZE, "hidden_size": MAX_SIZE, "num_hidden_layers": MAX_LAYERS,
                  "num_attention_heads": MAX_SIZE, "num_key_value_heads": MAX_SIZE, "head_dim": MAX_SIZE,
                  "max_position_embeddings": MAX_CONTEXT, "original_max_position_embeddings": MAX_CONTEXT,
                  "num_local_experts": MAX_SIZE, "num_experts": MAX_SIZE, "num_experts_per_tok": MAX_SIZE,
                  "moe_intermediate_size": MAX_SIZE, "sliding_window": MAX_CONTEXT,
                  "sliding_window_pattern": MAX_LAYERS, "decoder_sparse_step": MAX_LAYERS}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_NON_NEGATIVE_INTS = {"intermediate_size": MAX_SIZE, "shared_expert_intermediate_size": MAX_SIZE}
_NUMBERS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor", "swiglu_limit",
            "swiglu_alpha", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping")
_BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "norm_topk_prob",
          "use_bidirectional_attention")
_DICTS = ("rope_scaling", "rope_parameters")
_LISTS = ("architectures", "layer_types", "mlp_only_layers")
_TOKEN_IDS = ("bos_token_id", "eos_token_id")


def check_hf_config(cfg: Any, path: Path) -> None:
    """Raise ModelFileError for the first value of config.json (at ``path``) of the wrong type
    or out of range. A null stands for an absent key, as from_hf_config reads it."""
    if not isinstance(cfg, dict):
        raise ModelFileError(path, None, f"must hold a JSON object, not {type(cfg).__name__}")
    for key in _REQUIRED:
        if cfg.get(key) is None:
            raise ModelFileError(path, key, "is missing")
    for key, high in (_POSITIVE_INTS | _NON_NEGATIVE_INTS).items():
        value = cfg.get(key)
        low = 0 if key in _NON_NEGATIVE_INTS else 1
        if value is not None and (not _is_int(value) or not low <= value <= high):
            raise ModelFileError(path, key, f"must be an integer from {low} to {high}, got {shown(value)}")
    for key in _NUMBERS:
        value = cfg.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise ModelFileError(path, key, f"must be a non-negative number, got {shown(value)}")
    for keys, kind in ((_BOOLS, bool), (_DICTS, dict), (_LISTS, list)):
        for key in keys:
            value = cfg.get(key)
            if value is not None and not isinstance(value, kind):
                raise ModelFileError(path, key, f"must be a JSON {_JSON_NAMES[kind]}, got {shown(value)}")
    for key in _TOKEN_IDS:
        value = cfg.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_int(i) and i >= 0 for i in ids):
            raise ModelFileError(path, key, f"must be a token id or a list of them, got {shown(value)}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv_heads:
        raise ModelFileError(path, "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise ModelFileError(path, "num_attention_heads", f"{heads} does not divide hidden_size "
                                                          f"{cfg['hidden_size']} (and no head_dim is given)")


def check_fits(arch: ModelArch, weight_bytes: int, path: Path) -> None:
    """Raise ModelFileError where ``arch`` (read from ``path``) needs more parameters than
    ``weight_bytes`` of weights can hold: building it would allocate what the file never had."""
    need = arch.num_parameters
    if need * _MIN_BITS_PER_WEIGHT > weight_bytes * 8:
        raise ModelFileError(path, None, (
            f"the shape it states (vocab {arch.vocab_size}, hidden {arch.hidden_size}, intermediate "
            f"{arch.intermediate_size}, {arch.num_layers} layers, {arch.num_heads} heads of {arch.head_dim}, "
            f"{arch.num_experts} experts) has {need} parameters; the {weight_bytes} bytes of weights hold "
            f"at most {weight_bytes * 8 // _MIN_BITS_PER_WEIGHT}"))


_JSON_NAMES = {bool: "boolean", dict: "object", list: "array"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)

