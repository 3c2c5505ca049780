"""Where each checkpoint tensor goes in the model, and every parameter's full (one-rank)
shape and how tensor parallelism splits it."""

from __future__ import annotations

from travelator.model.arch import ModelArch
from travelator.model.layers import Shard
from travelator.model.tp_group import TPGroup


# HF checkpoint names (without "model.") -> our parameters. Within a layer, q/k/v and gate/up
# are fused: the second element is the index of the part a tensor fills.
MODEL_TENSORS = {
    "embed_tokens.weight": "embed",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head",
}
LAYER_TENSORS: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "self_attn.qkv_proj.weight": ("self_attn.qkv_weight", None),  # Phi-3: fused in the checkpoint
    "self_attn.q_proj.weight": ("self_attn.qkv_weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_bias", None),  # gpt-oss
    "self_attn.sinks": ("self_attn.sinks", None),  # gpt-oss
    "self_attn.sinks.weight": ("self_attn.sinks", None),  # gpt-oss's GGUF
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),  # Gemma 3: on attention's output
    "pre_feedforward_layernorm.weight": ("pre_mlp_norm.weight", None),  # Gemma 3
    "post_feedforward_layernorm.weight": ("post_mlp_norm.weight", None),  # Gemma 3
    "mlp.gate_up_proj.weight": ("mlp.gate_up_weight", None),  # Phi-3: gate, then up
    "mlp.gate_proj.weight": ("mlp.gate_up_weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_weight", 1),
    "mlp.down_proj.weight": ("mlp.down_weight", None),
}

# A mixture's tensors (Qwen3-MoE's names under mlp., Mixtral's under block_sparse_moe.): the
# router, and per expert its gate, up and down projections.
_MOE_ROUTERS = {"mlp.gate.weight": "mlp.router_weight", "block_sparse_moe.gate.weight": "mlp.router_weight",
                "mlp.router.weight": "mlp.router_weight", "mlp.router.bias": "mlp.router_bias",  # gpt-oss: router.
                "mlp.gate.bias": "mlp.router_bias"}  # gpt-oss's GGUF
_EXPERT_TENSORS: dict[str, tuple[str, int | None]] = {
    "gate_proj.weight": ("gate_up_weight", 0), "up_proj.weight": ("gate_up_weight", 1),
    "down_proj.weight": ("down_weight", None),
    "gate_proj.bias": ("gate_up_bias", 0), "up_proj.bias": ("gate_up_bias", 1), "down_proj.bias": ("down_bias", None),
    "w1.weight": ("gate_up_weight", 0), "w3.weight": ("gate_up_weight", 1), "w2.weight": ("down_weight", None),
}


def expert_target(rest: str) -> tuple[str, int | None] | None:
    """(parameter within the layer, fused part) of a mixture's tensor name, or None."""
    if rest in _MOE_ROUTERS:
        return _MOE_ROUTERS[rest], None
    prefix, _, tail = rest.partition(".experts.")
    if prefix not in ("mlp", "block_sparse_moe") or not tail:
        return None
    expert, _, tensor = tail.partition(".")
    if not expert.isdigit() or tensor not in _EXPERT_TENSORS:
        return None
    field, part = _EXPERT_TENSORS[tensor]
    return f"mlp.experts.{int(expert)}.{field}", part


def parameter_layout(arch: ModelArch, placed: TPGroup | None = None) -> tuple[dict[str, Shard], dict[str, tuple[int, ...]]]:
    """Every parameter's full (one-rank) shape and how it is split over ranks; ``placed``: the
    group whose ranks hold whole experts (expert parallelism)."""
    h, v = arch.hidden_size, arch.vocab_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    replicated = Shard()
    vocab = Shard(0, (v,))
    shards = {"embed": vocab, "norm.weight": replicated, "lm_head": vocab}
    shapes = {"embed": (v, h), "norm.weight": (h,), "lm_head": (v, h)}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        shards |= {
            p + "input_norm.weight": replicated,
            p + "self_attn.qkv_weight": Shard(0, (q, kv, kv)),  # column-parallel: own heads
            p + "self_attn.qkv_bias": Shard(0, (q, kv, kv)),
            p + "self_attn.o_weight": Shard(1, (q,)),  # row-parallel, then all-reduce
            p + "self_attn.q_norm.weight": replicated,  # over head_dim: the same on every rank
            p + "self_attn.k_norm.weight": replicated,
            p + "post_attn_norm.weight": replicated,
            p + "pre_mlp_norm.weight": replicated,
            p + "post_mlp_norm.weight": replicated,
            p + "mlp.gate_up_weight": Shard(0, (inter, inter)),
            p + "mlp.down_weight": Shard(1, (inter,)),
        }
        shapes |= {
            p + "input_norm.weight": (h,),
            p + "self_attn.qkv_weight": (q + 2 * kv, h),
            p + "self_attn.qkv_bias": (q + 2 * kv,),
            p + "self_attn.o_weight": (h, q),
            p + "self_attn.q_norm.weight": (arch.head_dim,),
            p + "self_attn.k_norm.weight": (arch.head_dim,),
            p + "post_attn_norm.weight": (h,),
            p + "pre_mlp_norm.weight": (h,),
            p + "post_mlp_norm.weight": (h,),
            p + "mlp.gate_up_weight": (2 * inter, h),
            p + "mlp.down_weight": (h, inter),
        }
        if arch.output_bias:
            shards[p + "self_attn.o_bias"], shapes[p + "self_attn.o_bias"] = replicated, (h,)  # added on rank 0
        if arch.attention_sinks:
            shards[p + "self_attn.sinks"] = Shard(0, (arch.num_heads,))  # each rank its heads'
            shapes[p + "self_attn.sinks"] = (arch.num_heads,)
        if arch.is_moe_layer(i):
            _moe_layout(arch, p, shards, shapes, placed)
    return shards, shapes


def _moe_layout(arch: ModelArch, p: str, shards: dict[str, Shard], shapes: dict[str, tuple[int, ...]],
                placed: TPGroup | None) -> None:
    """A mixture layer's parameters: the router replicated, each expert split as the MLP is, or
    (``placed``) whole on its rank."""
    h, inter = arch.hidden_size, arch.expert_intermediate_size
    shards[p + "mlp.router_weight"], shapes[p + "mlp.router_weight"] = Shard(), (arch.num_experts, h)
    shards[p + "mlp.router_bias"], shapes[p + "mlp.router_bias"] = Shard(), (arch.num_experts,)
    for e in range(arch.num_experts):
        q = f"{p}mlp.experts.{e}."
        if placed is not None:
            owner = placed.expert_rank(e)
            shards[q + "gate_up_weight"] = shards[q + "gate_up_bias"] = Shard(0, (inter, inter), owner)
            shards[q + "down_weight"] = shards[q + "down_bias"] = Shard(owner=owner)
        else:
            shards[q + "gate_up_weight"] = shards[q + "gate_up_bias"] = Shard(0, (inter, inter))
            shards[q + "down_weight"] = Shard(1, (inter,))
            shards[q + "down_bias"] = Shard()  # added on rank 0
        shapes[q + "gate_up_weight"], shapes[q + "gate_up_bias"] = (2 * inter, h), (2 * inter,)
        shapes[q + "down_weight"], shapes[q + "down_bias"] = (h, inter), (h,)
