"""Building blocks of the Llama family, written for one flat batch of tokens [T, ...]."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``unit_offset`` (Gemma): the checkpoint's weight w scales by 1 + w, in float32, rounded
    once at the end; otherwise the normalised x is rounded to the model dtype, then scaled by w,
    as Llama's reference does."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 like the reference implementations, then back to the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of rotary_dim / 2 pairs, and the factor cos and sin are scaled by
    (LongRoPE's attention factor; 1 otherwise). ``max_positions``: the engine's context, which
    picks LongRoPE's factors once for every position, as llama.cpp picks them by its context:
    long where the context passes the pretraining length, short otherwise (transformers picks
    per forward pass by the sequence's length, which equals this rule for a sequence that
    stays on one side of that length)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq.float(), 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor"] if max_positions > old_len else scaling["short_factor"]
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope: {len(factors)} factors for {rotary_dim // 2} rotary pairs")
        # As transformers computes them: in float32, the factor times base ** (2i / dim).
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            ratio = scaling.get("factor") or scaling["max_position_embeddings"] / old_len
            attention_factor = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(old_len))
        return inv_freq, float(attention_factor)
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope, yarn)")


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): pairs that turn fewer than beta_slow times over the pretraining length are
    interpolated by the factor, those that turn more than beta_fast times kept, a linear ramp
    between; cos and sin scaled by 0.1 ln(factor) + 1 (or the config's attention_factor)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_of(turns: float) -> float:  # the pair index that turns `turns` times over old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(fast), pair_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kept = 1 - ramp  # the share of each pair's frequency kept as it is
    inv_freq = (1 / (factor * freqs)) * (1 - kept) + (1 / freqs) * kept
    def mscale(scale: float = 1.0) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention_factor = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of the first ``rotary_dim`` numbers of each head ("NeoX" layout,
    as in HF checkpoints); the rest of the head passes through (partial rotary, Phi-4-mini).

    GGUF llama checkpoints rotate adjacent pairs instead; the loader permutes their Q/K
    rows into this layout, so one kernel serves both.
    """

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(rotary_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x.float().split([half, half, x.shape[-1] - 2 * half], dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: the gate clamped above at limit, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True, slots=True)
class Shard:
    """How one parameter is split over the tensor-parallel ranks (Megatron style).

    Along ``dim``, each of the parameter's fused ``parts`` (full sizes, e.g. q, k, v of a
    fused QKV) is cut into ``size`` equal contiguous pieces, and rank r keeps piece r of
    every part, in order. ``dim=None``: replicated. A part that does not divide evenly
    (only the vocabulary may) gets a zero-padded last piece. ``owner``: the whole parameter
    lives on that rank only (a mixture's expert under expert parallelism), its parts whole, as
    on one rank; the other ranks hold an empty one and skip its tensors.
    """

    dim: int | None = None
    parts: tuple[int, ...] = ()
    owner: int | None = None

    def held_by(self, rank: int) -> bool:
        return self.owner is None or self.owner == rank

    def piece(self, part: int, size: int) -> int:
        return -(-self.parts[part] // self._ranks(size))

    def _ranks(self, size: int) -> int:
        """The ranks the parameter is cut over: 1 for a placed one."""
        return 1 if self.owner is not None else size

    def local_shape(self, full_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        if self.dim is None:
            return full_shape
        shape = list(full_shape)
        shape[self.dim] = sum(self.piece(i, size) for i in range(len(self.parts)))
        return tuple(shape)

    def local_offset(self, part: int, size: int) -> int:
        """Where this rank's piece of ``part`` starts in the local parameter."""
        return sum(self.piece(i, size) for i in range(part))

    def part_shape(self, full_shape: tuple[int, ...], part: int) -> tuple[int, ...]:
        if self.dim is None:
            return full_shape
        shape = list(full_shape)
        shape[self.dim] = self.parts[part]
        return tuple(shape)

    def take(self, full_part: torch.Tensor, part: int, rank: int, size: int) -> torch.Tensor:
        """This rank's piece of one full part (a whole HF tensor such as q_proj.weight)."""
        if self.dim is None or self._ranks(size) == 1:
            return full_part
        n = self.piece(part, size)
        total = full_part.shape[self.dim]
        lo = min(rank * n, total)
        piece = full_part.narrow(self.dim, lo, min(n, total - lo))
        if piece.shape[self.dim] < n:
            pad = list(piece.shape)
            pad[self.dim] = n - piece.shape[self.dim]
            piece = torch.cat([piece, piece.new_zeros(pad)], dim=self.dim)
        return piece

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's shard of the full (fused) parameter."""
        if self.dim is None or self._ranks(size) == 1:
            return full
        pieces, start = [], 0
        for i, p in enumerate(self.parts):
            pieces.append(self.take(full.narrow(self.dim, start, p), i, rank, size))
            start += p
        return torch.cat(pieces, dim=self.dim)
