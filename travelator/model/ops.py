"""The per-token operations of the Llama block, in two implementations.

``TorchOps`` is plain torch: the reference, and the path on GPUs and on machines where
the native kernels do not build. ``NativeOps`` runs the same operations through
travelator's C++ CPU kernels (fused RMSNorm with the residual add, SiLU * up, rotary in
place, paged attention in one call per layer, a vectorised argmax for the sampler) and keeps
bf16 weights pre-packed for oneDNN, so no linear layer reorders its weight at every call
(about 1.5x faster at the row counts of a decode step).

The model holds one of them for its whole life; ``make_ops`` picks it from the
``kernels`` setting.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from travelator import kernels
from travelator.model.attention import AttentionBackend
from travelator.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

# Rows of x up to which bf16 linears use the streaming kernel (kMaxRows in small_m_linear.cpp).
SMALL_M_ROWS = 2


class TorchOps:
    attention_backend: AttentionBackend = "torch"

    def prepare(self, linear_weights: Iterable[torch.Tensor]) -> None:
        """Called once the weights are final (loaded and on their device)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual stream and the next block's input."""
        x = x + delta
        return x, norm(x)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(positions, q, k)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (the sampler's greedy pick)."""
        return x.argmax(dim=-1)


class NativeOps(TorchOps):
    attention_backend: AttentionBackend = "native"

    def __init__(self) -> None:
        kernels.load()
        self._ops = torch.ops.travelator
        # Parameter -> its oneDNN-packed copy (bf16 weights on the CPU only).
        self._packed: dict[torch.Tensor, torch.Tensor] = {}
        # Built only where the compiler targets AVX512-BF16.
        self._small_m_linear = getattr(self._ops, "small_m_linear", None)

    def prepare(self, linear_weights: Iterable[torch.Tensor]) -> None:
        if not torch.backends.mkldnn.is_available():
            return
        for w in linear_weights:
            if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2:
                self._packed[w] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)

    def linear(self, x, weight, bias=None):
        packed = self._packed.get(weight)
        if packed is None:
            return F.linear(x, weight, bias)
        if (self._small_m_linear is not None and bias is None and x.dim() == 2
                and x.shape[0] <= SMALL_M_ROWS and x.dtype == torch.bfloat16):
            # One or two rows only stream the weights: read in their natural layout.
            return self._small_m_linear(x.contiguous(), weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def rms_norm(self, x, norm):
        return self._ops.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x, delta, norm):
        normed = self._ops.add_rms_norm_(x, delta, norm.weight, norm.eps)  # x += delta in place
        return x, normed

    def silu_and_mul(self, gate_up):
        return self._ops.silu_and_mul(gate_up)

    def rope(self, positions, q, k, rope):
        self._ops.rope_(q, k, positions, rope.cos, rope.sin)  # in place, through the views
        return q, k

    def argmax(self, x):
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous():
            return x.argmax(dim=-1)
        return self._ops.argmax_rows(x)


def make_ops(kernels_setting: str, device: torch.device) -> TorchOps:
    """``auto``: the native kernels on the CPU where they build, else torch."""
    if kernels_setting not in ("auto", "native", "torch"):
        raise ValueError(f"unknown kernels {kernels_setting!r}; use auto, native or torch")
    if kernels_setting == "torch" or (kernels_setting == "auto" and device.type != "cpu"):
        return TorchOps()
    if device.type != "cpu":
        raise ValueError("the native kernels run on the CPU only; use kernels='torch' or 'auto'")
    if kernels_setting == "native":
        return NativeOps()  # raises with the compiler's message
    return NativeOps() if kernels.available() else TorchOps()
