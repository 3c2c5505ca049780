"""The layers every architecture's decoder layer is built from, written for one flat batch of
tokens [T, ...]: attention (fused QKV, optional per-head q/k norm, rope, paged attention,
output projection) and the gated MLP (SwiGLU or GeGLU). Each architecture's module
(llama.py, gemma3.py) arranges them with its norms."""

from __future__ import annotations

import torch
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.attention import PagedAttention
from travelator.model.layers import RMSNorm, RotaryEmbedding
from travelator.model.ops import TorchOps
from travelator.model.tp_group import TPGroup


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    """Fused QKV projection, per-head q/k norm (Qwen3), rope, paged attention over the KV
    cache, output projection."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps, layer: int,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        self.ops = ops
        self.tp = tp
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads // size, arch.num_kv_heads // size, d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qkv_weight = param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size, dtype=dtype) if arch.attention_bias else None
        self.o_weight = param(h, self.q_size, dtype=dtype)
        # gpt-oss: a bias on the output (added once, on rank 0's share, before the all-reduce)
        # and a sink logit per query head.
        self.o_bias = param(h, dtype=dtype) if arch.output_bias else None
        self.sinks = param(self.num_heads, dtype=dtype) if arch.attention_sinks else None
        offset = arch.norm_unit_offset
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dtype, unit_offset=offset) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dtype, unit_offset=offset) if arch.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, window=arch.window_of(layer),
                                   scale=arch.attention_scale)

    def forward(self, x, positions, rope: RotaryEmbedding, k_cache, v_cache, meta):
        t = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.ops.head_rms_norm(q, self.q_norm), self.ops.head_rms_norm(k, self.k_norm)
        q, k = self.ops.rope(positions, q, k, rope)
        attn = self.attn(q, k, v, k_cache, v_cache, meta, self.sinks)
        first_rank = self.tp is None or self.tp.rank == 0
        o = self.ops.linear(attn.reshape(t, self.q_size), self.o_weight, self.o_bias if first_rank else None)
        if self.tp is not None:
            self.tp.all_reduce(o)
        return o


class MLP(nn.Module):
    """Gated MLP: fused gate/up projection, act(gate) * up (SiLU: SwiGLU; tanh-approximated
    GELU: GeGLU, Gemma), down projection."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        self.ops = ops
        self.tp = tp
        inter = arch.intermediate_size // size
        self.gate_up_weight = param(2 * inter, arch.hidden_size, dtype=dtype)
        self.down_weight = param(arch.hidden_size, inter, dtype=dtype)
        self.gated_act = ops.gelu_tanh_and_mul if arch.hidden_act == "gelu_tanh" else ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        out = ops.linear(self.gated_act(ops.linear(x, self.gate_up_weight)), self.down_weight)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


