"""Gemma 3's decoder layer (the text model): the shared attention and MLP (blocks.py) inside
"sandwich" norms, each a unit-offset RMSNorm (scale 1 + w):

    x = x + post_attn_norm(attention(input_norm(x)))
    x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))

Attention normalises each query and key head, scales scores by query_pre_attn_scalar ** -0.5,
and alternates sliding-window layers (rope base ``local_rope_theta``) with global ones (rope
base ``rope_theta`` with the model's rope scaling): ``ModelArch.window_of`` says which. The MLP
is GeGLU. The model around the layers (embedding scaled by sqrt(hidden), tied LM head, optional
final logit soft-capping) is llama.py's ``LlamaModel``, which reads these from ``ModelArch``.
"""

from __future__ import annotations

import torch
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.blocks import MLP, Attention
from travelator.model.layers import RMSNorm, RotaryEmbedding
from travelator.model.ops import TorchOps
from travelator.model.tp_group import TPGroup


class Gemma3DecoderLayer(nn.Module):
    """Takes and returns (residual stream, the delta its next norm adds), as llama.py's
    DecoderLayer, so every residual add rides on an add + norm."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps, layer: int,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.ops = ops
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_norm = RMSNorm(h, eps, dtype, unit_offset=True)
        self.self_attn = Attention(arch, dtype, ops, layer, tp)
        self.post_attn_norm = RMSNorm(h, eps, dtype, unit_offset=True)
        self.pre_mlp_norm = RMSNorm(h, eps, dtype, unit_offset=True)
        self.mlp = MLP(arch, dtype, ops, tp)
        self.post_mlp_norm = RMSNorm(h, eps, dtype, unit_offset=True)

    def forward(self, x, delta, positions, rope: RotaryEmbedding, k_cache, v_cache, meta):
        ops = self.ops
        if delta is None:
            normed = ops.rms_norm(x, self.input_norm)
        else:
            x, normed = ops.add_rms_norm(x, delta, self.input_norm)
        h = self.self_attn(normed, positions, rope, k_cache, v_cache, meta)
        x, normed = ops.add_rms_norm(x, ops.rms_norm(h, self.post_attn_norm), self.pre_mlp_norm)
        return x, ops.rms_norm(self.mlp(normed), self.post_mlp_norm)
