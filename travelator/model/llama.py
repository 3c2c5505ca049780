"""The Llama family (Llama, Mistral, Qwen2) written for flat batches.

Selective batching: embedding, norms, the fused QKV and output projections, the
MLP and the LM head run once over all tokens of all requests in the step; only
attention looks at requests one by one (see attention.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.attention import AttentionMetadata, PagedAttention
from travelator.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.q_size = arch.num_heads * d
        self.kv_size = arch.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.input_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if arch.attention_bias else None
        self.o_weight = _param(h, self.q_size, dtype=dtype)
        self.post_attn_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.gate_up_weight = _param(2 * arch.intermediate_size, h, dtype=dtype)
        self.down_weight = _param(h, arch.intermediate_size, dtype=dtype)
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, d)

    def forward(self, x, positions, rope: RotaryEmbedding, k_cache, v_cache, meta):
        t = x.shape[0]
        qkv = F.linear(self.input_norm(x), self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        attn = self.attn(q, k, v, k_cache, v_cache, meta)
        x = x + F.linear(attn.reshape(t, self.q_size), self.o_weight)
        mlp = F.linear(silu_and_mul(F.linear(self.post_attn_norm(x), self.gate_up_weight)),
                       self.down_weight)
        return x + mlp


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = None if arch.tie_word_embeddings else _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, k_cache, v_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    # ---- weights --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into our layout.

        Every parameter must be written exactly once; a missing or unexpected
        tensor is an error, so a truncated or foreign checkpoint never runs.
        """
        a = self.arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        inter = a.intermediate_size
        expected = {n for n, _ in self.named_parameters()}
        written: set[str] = set()
        # target name, slice of its first dim
        fused = {
            "self_attn.q_proj.weight": ("qkv_weight", 0, q),
            "self_attn.k_proj.weight": ("qkv_weight", q, q + kv),
            "self_attn.v_proj.weight": ("qkv_weight", q + kv, q + 2 * kv),
            "self_attn.q_proj.bias": ("qkv_bias", 0, q),
            "self_attn.k_proj.bias": ("qkv_bias", q, q + kv),
            "self_attn.v_proj.bias": ("qkv_bias", q + kv, q + 2 * kv),
            "mlp.gate_proj.weight": ("gate_up_weight", 0, inter),
            "mlp.up_proj.weight": ("gate_up_weight", inter, 2 * inter),
        }
        plain = {
            "self_attn.o_proj.weight": "o_weight",
            "mlp.down_proj.weight": "down_weight",
            "input_layernorm.weight": "input_norm.weight",
            "post_attention_layernorm.weight": "post_attn_norm.weight",
        }
        params = dict(self.named_parameters())
        parts_written: dict[str, int] = {}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "embed_tokens.weight":
                target, sl = "embed", None
            elif name == "norm.weight":
                target, sl = "norm.weight", None
            elif name == "lm_head.weight":
                if self.lm_head is None:
                    continue  # tied: some checkpoints store the copy anyway
                target, sl = "lm_head", None
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                if rest in fused:
                    field, lo, hi = fused[rest]
                    target, sl = f"layers.{idx}.{field}", (lo, hi)
                elif rest in plain:
                    target, sl = f"layers.{idx}.{plain[rest]}", None
                elif rest.endswith("rotary_emb.inv_freq"):
                    continue
                else:
                    raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            elif name.endswith("rotary_emb.inv_freq"):
                continue
            else:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            dest = params[target].data
            if sl is not None:
                dest = dest[sl[0] : sl[1]]
                parts_written[target] = parts_written.get(target, 0) + 1
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            if sl is None or parts_written[target] == self._num_parts(target):
                written.add(target)
        missing = expected - written
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")

    def _num_parts(self, target: str) -> int:
        return 2 if target.endswith("gate_up_weight") else 3

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights with a realistic scale, for benchmarks without a download."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
