"""The shape of a decoder model, read from a HF config.json or GGUF metadata, plus built-in
presets of realistic shapes for random-weight benchmarks.

``SUPPORTED_ARCHITECTURES`` is the one registry of what loads: a HF config's ``architectures``
entry and a GGUF file's ``general.architecture`` name the same family."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 and Phi-4-mini: fused QKV and gate/up, LongRoPE
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text model (model_type gemma3_text)
    "MixtralForCausalLM": "mixtral",  # Mistral's layers, a mixture of experts for the MLP
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, many small experts
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, windows on every other layer, biased experts
}
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config model_type -> family, where they differ
# GGUF ``general.architecture`` -> family (llama.cpp writes Mistral's as "llama").
# A llama file with experts (llama.expert_count) is Mixtral.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3",
                      "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
# Families whose every layer slides when the config gives a window (others need use_sliding_window).
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3")
# Families whose attention normalises each query and key head (RMSNorm over head_dim) before rope.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3")


def unsupported_architecture(name: object) -> ValueError:
    return ValueError(f"unsupported architecture {name!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)} "
                      f"(HF config), {sorted(GGUF_ARCHITECTURES)} (GGUF)")


@dataclass(slots=True, frozen=True)
class ModelArch:
    family: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    sliding_window: int | None = None  # keys a query sees in the layers window_of names
    # Per layer "sliding_attention" or "full_attention" (Gemma 3 interleaves them); None: every
    # layer slides when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before rope
    rotary_dim: int | None = None  # rope turns the first rotary_dim numbers of a head (None: all)
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    # Gemma 3: norms scale by 1 + w, the embedding by sqrt(hidden), the attention scores by
    # attention_scale (None: head_dim ** -0.5), sliding layers take rope base local_rope_theta
    # (without rope_scaling), and the logits may be soft-capped.
    norm_unit_offset: bool = False
    embed_scale: bool = False
    attention_scale: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    # A mixture of experts in place of the MLP (model/moe.py) where num_experts > 0, but in
    # dense_layers (Qwen3-MoE's mlp_only_layers), which keep the MLP of intermediate_size. Each
    # token takes the experts_per_token largest of the router's softmax, renormalised to sum to 1
    # where norm_topk_prob says so.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: biases on the router and the experts, the experts' clamped SwiGLU (limit: None for
    # SiLU * up), a bias on the attention output, and a learned sink logit per attention head.
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    output_bias: bool = False
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Embeddings: the leading dimensions a Matryoshka-trained model's vectors may be cut to
    # (config.json's matryoshka_dimensions); () for a model not trained so: full length only.
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.rotary_size % 2 or not 0 < self.rotary_size <= self.head_dim:
            raise ValueError("the rotary part of a head must be even and at most head_dim")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token must be 1 to {self.num_experts}, not {self.experts_per_token}")
        if self.num_experts and self.expert_intermediate_size <= 0:
            raise ValueError("a mixture of experts needs the experts' intermediate size")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rotary_size(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window of one layer's attention (None: it sees the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def num_parameters(self) -> int:
        return self._parameters(self.num_experts)

    @property
    def active_parameters(self) -> int:
        """The parameters one token reads: of a mixture's experts, only its experts_per_token."""
        return self._parameters(self.experts_per_token)

    def _parameters(self, experts: int) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layers = self.num_layers * (attn + 2 * h + (2 * d if self.qk_norm else 0))
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                layers += experts * 3 * h * self.expert_intermediate_size + self.num_experts * h
            else:
                layers += 3 * h * self.intermediate_size
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + lm_head

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
            if family not in SUPPORTED_ARCHITECTURES.values():
                raise unsupported_architecture(archs or family)
        if family == "gemma3":
            return _gemma3(cls, cfg)
        if family == "gpt_oss":
            return replace(cls.from_hf_config(dict(cfg, architectures=["MistralForCausalLM"])), **_gpt_oss(cfg))
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family in WINDOWED_FAMILIES) else None
        rope_params = cfg.get("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta")
            or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or cfg.get("attention_bias", False),
            sliding_window=window,
            qk_norm=family in QK_NORM_FAMILIES,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            matryoshka_dimensions=tuple(cfg.get("matryoshka_dimensions") or ()),
            **_experts(family, cfg),
        )


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields beside the Llama-shaped ones: sliding and full layers alternating (each
    sliding one sees `sliding_window` keys), biases on q, k, v and o, a sink per head, every layer a
    mixture (softmax over its top-k logits: the renormalised top-k of the softmax) of biased
    experts with the clamped SwiGLU, YaRN rope."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = cfg.get("attention_bias", True)
    return dict(
        family="gpt_oss", sliding_window=cfg.get("sliding_window", 128), layer_types=tuple(types),
        attention_bias=bias, output_bias=bias, attention_sinks=True,
        num_experts=int(cfg.get("num_local_experts") or cfg["num_experts"]),
        experts_per_token=int(cfg["num_experts_per_tok"]), expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True, expert_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), rope_scaling=_rope_scaling(cfg),
    )


def _experts(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config's ModelArch fields (none for a dense family). Mixtral always
    renormalises its top-k; Qwen3-MoE where norm_topk_prob says so, and keeps a dense MLP in
    mlp_only_layers and in layers off its decoder_sparse_step."""
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        raise ValueError(f"{family} config names no experts (num_local_experts / num_experts)")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported")
    fields: dict[str, Any] = dict(num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]))
    if family == "mixtral":
        return fields | dict(expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
    return fields | dict(expert_intermediate_size=cfg["moe_intermediate_size"],
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)


# What every Gemma 3 is, whatever its config or file says: ModelArch fields.
GEMMA3_FEATURES = dict(qk_norm=True, hidden_act="gelu_tanh", norm_unit_offset=True, embed_scale=True)


def _gemma3(cls: type[ModelArch], cfg: dict[str, Any]) -> ModelArch:
    """Gemma 3's text config: interleaved sliding and full layers, each kind with its own rope
    (transformers 5 writes ``rope_parameters`` per layer type; older configs rope_theta,
    rope_local_base_freq and rope_scaling)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 activation {cfg['hidden_activation']!r} is not supported")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # every sliding_window_pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") if "full_attention" in rope else None
    local = rope.get("sliding_attention") if "sliding_attention" in rope else None
    theta = (full or {}).get("rope_theta") or cfg.get("rope_theta", 1_000_000.0)
    local_theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq", 10_000.0)
    if local is not None and local.get("rope_type", "default") != "default":
        raise ValueError("Gemma 3 sliding layers with scaled rope are not supported")
    scaling = _rope_scaling({"rope_scaling": full} if full is not None else cfg)
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id", 1)
    return cls(
        family="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim", 256),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=cfg.get("attention_bias", False),
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(types),
        **GEMMA3_FEATURES,
        attention_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        local_rope_theta=local_theta,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
    )


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind == "longrope":  # Phi-3 keeps these two beside rope_scaling
        original = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        return dict(scaling, rope_type=kind, original_max_position_embeddings=original,
                    max_position_embeddings=cfg["max_position_embeddings"])
    return dict(scaling, rope_type=kind)


# Random-weight presets: realistic shapes so a user can benchmark with no download.
PRESETS: dict[str, ModelArch] = {
    # For tests and smoke runs.
    "tiny": ModelArch("llama", 1024, 128, 352, 2, 4, 2, 32, max_position_embeddings=4096),
    # ~50M: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408.
    "llama-50m": ModelArch("llama", 32000, 512, 1408, 8, 8, 4, 64, max_position_embeddings=4096),
    # ~250M: hidden 1024, 16 layers, 16 heads, 8 KV heads, intermediate 2816.
    "llama-250m": ModelArch("llama", 32000, 1024, 2816, 16, 16, 8, 64, max_position_embeddings=4096),
    # Qwen3 of the tiny and 50M shapes: the same layers with per-head q/k norms.
    "qwen3-tiny": ModelArch("qwen3", 1024, 128, 352, 2, 4, 2, 32, max_position_embeddings=4096, qk_norm=True),
    "qwen3-50m": ModelArch("qwen3", 32000, 512, 1408, 8, 8, 4, 64, max_position_embeddings=4096, qk_norm=True),
    # Mixtures of experts in Qwen3-MoE's proportions (top-8 of many small experts): a tiny one for
    # tests, and ~0.9B total / ~0.2B active beside qwen3-0.2b, the dense model of the same
    # attention whose MLP is as wide as a token's eight experts.
    "qwen3-moe-tiny": ModelArch("qwen3_moe", 1024, 128, 352, 2, 4, 2, 32, max_position_embeddings=4096,
                                qk_norm=True, num_experts=16, experts_per_token=4, expert_intermediate_size=64,
                                norm_topk_prob=True),
    "qwen3-moe-1b": ModelArch("qwen3_moe", 32000, 1024, 2048, 16, 16, 4, 64, max_position_embeddings=4096,
                              qk_norm=True, num_experts=64, experts_per_token=8, expert_intermediate_size=256,
                              norm_topk_prob=True),
    "qwen3-0.2b": ModelArch("qwen3", 32000, 1024, 2048, 16, 16, 4, 64, max_position_embeddings=4096, qk_norm=True),
    # The shape of Llama 3.2 1B (tied embeddings, llama3 rope scaling).
    "llama-1b": ModelArch(
        "llama", 128256, 2048, 8192, 16, 32, 8, 64,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    # The shape of Llama 3 8B (untied embeddings, no rope scaling): for GPU benchmarks.
    "llama-8b": ModelArch("llama", 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0,
                          max_position_embeddings=8192),
}


def preset(name: str) -> ModelArch:
    try:
        return replace(PRESETS[name], bos_token_id=1, eos_token_ids=(2,))
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; choose one of {sorted(PRESETS)}") from None
