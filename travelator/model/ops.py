"""The per-token operations of the Llama block, in two implementations.

``TorchOps`` is plain torch: the reference, and the path on GPUs and on machines where
the native kernels do not build. ``NativeOps`` runs the same operations through
travelator's C++ CPU kernels (fused RMSNorm with the residual add, SiLU * up, rotary in
place, paged attention in one call per layer, a vectorised argmax for the sampler) and keeps
bf16 weights laid out once for their GEMM: in blocks of 64 columns for travelator's own
``blocked_linear`` on CPUs with AVX512-BF16 and no AMX (faster than oneDNN there up to a
few hundred rows, within 10% of it past that), pre-packed for oneDNN elsewhere (so no linear layer reorders its
weight at every call: about 1.5x faster at the row counts of a decode step), or widened to
float32 on CPUs where oneDNN has no bf16 GEMM; steps of a few rows stream the natural-layout
weights through ``small_m_linear`` instead.

With ``batch_invariant``, ``NativeOps`` makes every row's numbers independent of the other
rows of the step: the native kernels already compute each row on its own, and linear layers
always run in tiles of exactly ``INVARIANT_ROWS`` rows (the last one padded), so the GEMM
library sees one shape and takes one code path whatever the batch (see docs/design.md).

The model holds one of them for its whole life; ``make_ops`` picks it from the
``kernels`` and ``batch_invariant`` settings.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from travelator import kernels
from travelator.model.attention import AttentionBackend
from travelator.model.layers import RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, silu_and_mul
from travelator.model.quant import (
    QUANT_KERNEL_ROWS,
    QUANT_KERNEL_ROWS_FLOAT32_GEMM,
    TILE_ROWS,
    Int8Weight,
    QuantizedWeight,
)

# Rows of every linear-layer call in batch-invariant mode.
INVARIANT_ROWS = 64
# Tiles of 64 output rows a quantized layer is dequantized in at a time (past the kernel's rows).
DEQUANT_TILES = 32


# Output columns of a block of a blocked_linear weight (csrc/blocked_linear.cpp).
BLOCK_COLUMNS = 64


def _over_rows(kernel, x: torch.Tensor) -> torch.Tensor:
    """A native linear kernel, which takes contiguous 2-D rows, over x of any leading shape.
    A 2-D contiguous x (the model's case) skips the reshapes: a quantized layer's call, four
    per layer in every decode step, spent 9 of its 21 us in them."""
    if x.dim() == 2 and x.is_contiguous():
        return kernel(x)
    out = kernel(x.reshape(-1, x.shape[-1]).contiguous())
    return out.reshape(*x.shape[:-1], out.shape[-1])


def blocked_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 64, K / 2, 64, 2]: for each 64 output columns, every pair of k in order,
    the columns' two weights side by side (the layout of csrc/blocked_linear.cpp)."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK_COLUMNS, BLOCK_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True, slots=True)
class StreamingLinear:
    """A linear layer as the native layer stack (model/layer_stack.py) calls it: the route of
    ``csrc/layer_stack.cpp`` (0 bf16 small_m_linear, 1 int8, 2 int4, 3 bf16 blocked_linear),
    its tensors, and whether it is quantized (which bounds its rows: ``NativeOps.streaming_rows``)."""

    route: int
    a: torch.Tensor
    b: torch.Tensor | None
    bias: torch.Tensor | None
    group: int
    out_features: int

    @property
    def quantized(self) -> bool:
        return self.route in (1, 2)


class TorchOps:
    attention_backend: AttentionBackend = "torch"
    # Prefill tiles on the native path's tiled kernel (numbers depend on the chunking).
    tiled_prefill_attention = False
    # The sampler's native draw (NativeOps); None: torch generators make the noise.
    exponential_race = None

    def prepare(self, linear_weights: Iterable[torch.Tensor]) -> None:
        """Called once the weights are final (loaded and on their device)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return _quantized_linear(x, weight, bias)

    def streaming_linear(self, weight: torch.Tensor | QuantizedWeight,
                         bias: torch.Tensor | None) -> StreamingLinear | None:
        """How the native layer stack calls this layer (None: it cannot; torch never does)."""
        return None

    def streaming_rows(self, quantized: bool) -> int:
        """The most rows of x for which ``linear`` takes the streaming kernel that
        ``streaming_linear`` names (0: none)."""
        return 0

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual stream and the next block's input."""
        x = x + delta
        return x, norm(x)

    def head_rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``norm`` over the last dimension of every head of x [T, heads, head_dim] (Qwen3's
        q/k norm); the native kernel writes x in place, through a view of the QKV output."""
        return norm(x)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): the tanh-approximated GELU of the gate times up."""
        return gelu_tanh_and_mul(gate_up)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(positions, q, k)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (the sampler's greedy pick)."""
        return x.argmax(dim=-1)

    def apply_token_bitmask(self, logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
        """Structured outputs, in place: ``logits[rows[k], j] = -inf`` where bit ``j % 32`` of
        ``masks[k, j // 32]`` (int32 words, llguidance's layout) is 0."""
        bits = torch.arange(32, dtype=torch.int32, device=masks.device)
        allowed = ((masks.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


class NativeOps(TorchOps):
    attention_backend: AttentionBackend = "native"

    def __init__(self, batch_invariant: bool = False, bf16_gemm: bool | None = None) -> None:
        """bf16_gemm: whether bf16 weights go to oneDNN's bf16 GEMM; None: where this CPU has
        one. False takes the widened float32 route of AVX2 machines (tests take it anywhere)."""
        kernels.load()
        self.batch_invariant = batch_invariant
        self._ops = torch.ops.travelator
        # Parameter -> its oneDNN-packed copy (bf16 weights on the CPU only).
        self._packed: dict[torch.Tensor, torch.Tensor] = {}
        # Parameter -> its copy for blocked_linear, built where the CPU has AVX512-BF16 and no
        # AMX: there it replaces the oneDNN copy (the same memory).
        self._blocked_linear = getattr(self._ops, "blocked_linear", None)
        self._blocked: dict[torch.Tensor, torch.Tensor] = {}
        # Parameter -> its float32 copy, packed for oneDNN: bf16 weights on CPUs where oneDNN
        # has no bf16 GEMM (no AVX512-BW/VL/DQ or AVX-NE-CONVERT: AVX2 machines), whose bf16
        # path in torch is 4-5x slower than float32's; packed, float32 runs 1.3-2.7x faster
        # than F.linear there. The products of bf16 numbers are exact in float32, so this is a
        # bf16 GEMM with float32 sums, as oneDNN's is. The bf16 weight stays (small_m_linear
        # reads it), so the weights take three times their bf16 bytes.
        self._widened: dict[torch.Tensor, torch.Tensor] = {}
        # Bias -> its float32 copy for the widened route, made at its first call (prepare sees
        # the weights only): a biased layer (Qwen2's QKV) converted its bias at every call.
        self._widened_biases: dict[torch.Tensor, torch.Tensor] = {}
        # Built where the compiler targets AVX512-BF16 or AVX2. A second code path chosen by
        # the row count would make a row's numbers depend on the batch: off when invariant.
        self._small_m_linear = None if batch_invariant else getattr(self._ops, "small_m_linear", None)
        # Rows of x up to which it is faster than the GEMM library (2 on AVX512-BF16, 4 on AVX2).
        self._small_m_rows = self._ops.small_m_linear_rows() if self._small_m_linear is not None else 0
        # int8/int4 weights at up to quant_kernel_rows rows (AVX512-VNNI or AVX2 builds); its rows do
        # not depend on each other, so it stays on when batch-invariant.
        self._quant_kernel_built = hasattr(self._ops, "quant_linear_int8")  # AVX512-VNNI or AVX2
        self._quant_dequantize_built = hasattr(self._ops, "quant_dequantize_int8")  # AVX512-BW or AVX2
        # Past quant_kernel_rows rows a quantized layer is dequantized, DEQUANT_TILES tiles of
        # output rows at a time, into this buffer (kept: a fresh one costs its page faults as
        # much as the work; bounded: at most DEQUANT_TILES * 64 columns of the weight).
        self._dequantized = torch.empty(0)
        # Likewise the tiled attention kernel for prefill tiles.
        self.tiled_prefill_attention = not batch_invariant
        # Whether oneDNN has a bf16 GEMM here (see _widened). Without one, torch's bf16 matmul
        # on dequantized columns takes seconds: they are dequantized to float32 instead.
        if bf16_gemm is None:
            bf16_gemm = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self._bf16_gemm = bf16_gemm
        # Rows of x up to which a quantized layer takes the integer kernel (any, when invariant).
        self.quant_kernel_rows = QUANT_KERNEL_ROWS if self._bf16_gemm else QUANT_KERNEL_ROWS_FLOAT32_GEMM

    def prepare(self, linear_weights: Iterable[torch.Tensor]) -> None:
        if not torch.backends.mkldnn.is_available():
            return
        for w in linear_weights:
            if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2:
                if (self._bf16_gemm and self._blocked_linear is not None and w.shape[0] % BLOCK_COLUMNS == 0
                        and w.shape[1] % 2 == 0 and w.shape[1] > 0):
                    self._blocked[w] = blocked_linear_weight(w)
                elif self._bf16_gemm:
                    self._packed[w] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                else:
                    self._widened[w] = torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), None)

    def linear(self, x, weight, bias=None):
        if not isinstance(weight, torch.Tensor):  # quantized: int8 / int4
            return self._quantized_layer(x, weight, bias)
        packed, widened, blocked = self._packed.get(weight), self._widened.get(weight), self._blocked.get(weight)
        if blocked is not None and x.dtype == torch.bfloat16:
            call = lambda rows: _over_rows(lambda flat: self._blocked_linear(flat, blocked, bias), rows)  # noqa: E731
        elif packed is not None:
            call = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # noqa: E731
        elif widened is not None:
            wide_bias = None if bias is None else self._widened_bias(bias)
            call = lambda rows: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
                rows.float(), widened, wide_bias, "none", [], "").to(rows.dtype)
        else:
            call = lambda rows: F.linear(rows, weight, bias)  # noqa: E731
        if self.batch_invariant:
            return _in_fixed_tiles(call, x)
        # Not blocked weights: blocked_linear streams a few rows faster (weights in one stream).
        prepared = packed is not None or widened is not None
        if (prepared and self._small_m_linear is not None and bias is None and x.dim() == 2
                and x.shape[0] <= self._small_m_rows and x.dtype == torch.bfloat16):
            # A few rows only stream the weights: read in their natural layout.
            return self._small_m_linear(x.contiguous(), weight)
        return call(x)

    def streaming_linear(self, weight, bias):
        if not isinstance(weight, torch.Tensor):
            if not self._quant_kernel_built:
                return None
            if isinstance(weight, Int8Weight):
                return StreamingLinear(1, weight.packed, weight.scales, bias, 0, weight.out_features)
            return StreamingLinear(2, weight.packed, weight.scales_zeros, bias, weight.group_size, weight.out_features)
        # As linear(): blocked_linear where the weight has its copy; else bf16 weights that are
        # prepared and have no bias stream through small_m_linear.
        blocked = self._blocked.get(weight)
        if blocked is not None and self._small_m_linear is not None:
            return StreamingLinear(3, blocked, None, bias, 0, weight.shape[0])
        prepared = weight in self._packed or weight in self._widened
        if self._small_m_linear is None or bias is not None or not prepared or weight.dtype != torch.bfloat16:
            return None
        return StreamingLinear(0, weight, None, None, 0, weight.shape[0])

    def streaming_rows(self, quantized):
        if not quantized:
            return self._small_m_rows
        if not self._quant_kernel_built:
            return 0
        return sys.maxsize if self.batch_invariant else self.quant_kernel_rows

    def decoder_layers(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], stack) -> torch.Tensor:
        """Every decoder layer in one native call (``stack``: a model/layer_stack.LayerStack)."""
        return self._ops.decoder_layers(
            x, positions, rope.cos, rope.sin, meta.slot_mapping, meta.query_start, meta.seq_lens,
            meta.block_tables, stack.norms, stack.head_norms, stack.k_caches(kv_caches), stack.v_caches(kv_caches),
            stack.linear_tensors, stack.linear_ints, stack.windows, stack.num_heads, stack.num_kv_heads, stack.head_dim,
            stack.eps, stack.scale, meta.tiled_prefill)

    def _widened_bias(self, bias: torch.Tensor) -> torch.Tensor:
        wide = self._widened_biases.get(bias)
        if wide is None:
            wide = self._widened_biases[bias] = bias.detach().float()
        return wide

    def _quantized_layer(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """Up to quant_kernel_rows rows, the engine's integer kernel, which streams the quantized
        bytes; its rows never depend on each other, so batch-invariant mode takes it for any
        count. More rows: the weight dequantized, then the GEMM of x's dtype (oneDNN; float32
        where there is no bf16 GEMM)."""
        native = x.dtype in (torch.bfloat16, torch.float32)
        n_rows = x.shape[0] if x.dim() == 2 else x.shape[:-1].numel()
        if native and self._quant_kernel_built and (self.batch_invariant or n_rows <= self.quant_kernel_rows):
            return self._quant_kernel(x, weight, bias)
        if native and self._quant_dequantize_built:
            call = lambda rows: self._dequantized_linear(rows, weight, bias)  # noqa: E731
        else:  # no native build, or float16: torch dequantizes the whole weight every call
            call = lambda rows: _quantized_linear(rows, weight, bias)  # noqa: E731
        return _in_fixed_tiles(call, x) if self.batch_invariant else call(x)

    def _quant_kernel(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            kernel = lambda rows: self._ops.quant_linear_int8(rows, weight.packed, weight.scales,  # noqa: E731
                                                              weight.out_features)
        else:
            kernel = lambda rows: self._ops.quant_linear_int4(rows, weight.packed, weight.scales_zeros,  # noqa: E731
                                                              weight.group_size, weight.out_features)
        out = _over_rows(kernel, x)
        return out if bias is None else out + bias

    def _dequantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        int8 = isinstance(weight, Int8Weight)
        k = weight.packed_in_features
        tiles = weight.packed.shape[0]
        width = min(tiles, DEQUANT_TILES) * TILE_ROWS
        gemm_dtype = x.dtype if self._bf16_gemm else torch.float32
        rows = rows.to(gemm_dtype)
        if self._dequantized.dtype != gemm_dtype or self._dequantized.numel() < k * width:
            self._dequantized = torch.empty(k * width, dtype=gemm_dtype)
        out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
        for t0 in range(0, tiles, DEQUANT_TILES):
            t1 = min(tiles, t0 + DEQUANT_TILES)
            w_t = self._dequantized[: k * (t1 - t0) * TILE_ROWS].view(k, (t1 - t0) * TILE_ROWS)  # W^T
            if int8:
                self._ops.quant_dequantize_int8(weight.packed[t0:t1], weight.scales[t0 * TILE_ROWS:t1 * TILE_ROWS], w_t)
            else:
                self._ops.quant_dequantize_int4(weight.packed[t0:t1], weight.scales_zeros[t0:t1], weight.group_size,
                                                w_t)
            n0, n1 = t0 * TILE_ROWS, min(weight.out_features, t1 * TILE_ROWS)
            out[:, n0:n1] = rows @ w_t[: weight.in_features, : n1 - n0]
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], weight.out_features)

    # Gemma's unit-offset norms (1 + w, rounded once) run in torch: the kernels round as Llama's.
    def rms_norm(self, x, norm):
        if norm.unit_offset:
            return super().rms_norm(x, norm)
        return self._ops.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x, delta, norm):
        if norm.unit_offset:
            return super().add_rms_norm(x, delta, norm)
        normed = self._ops.add_rms_norm_(x, delta, norm.weight, norm.eps)  # x += delta in place
        return x, normed

    def head_rms_norm(self, x, norm):
        if norm.unit_offset:
            return super().head_rms_norm(x, norm)
        self._ops.head_rms_norm_(x, norm.weight, norm.eps)
        return x

    def silu_and_mul(self, gate_up):
        return self._ops.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return self._ops.gelu_tanh_and_mul(gate_up)

    def rope(self, positions, q, k, rope):
        self._ops.rope_(q, k, positions, rope.cos, rope.sin)  # in place, through the views
        return q, k

    def argmax(self, x):
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous():
            return x.argmax(dim=-1)
        return self._ops.argmax_rows(x)

    def exponential_race(self, scores: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return self._ops.exponential_race(scores, seeds)

    def apply_token_bitmask(self, logits, masks, rows):
        if not logits.is_contiguous():
            return super().apply_token_bitmask(logits, masks, rows)
        self._ops.apply_token_bitmask_(logits, masks, rows)


def _quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    out = weight.linear(x.reshape(-1, shape[-1]).contiguous())
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])


def _in_fixed_tiles(call, x: torch.Tensor) -> torch.Tensor:
    """``call`` on tiles of exactly INVARIANT_ROWS rows of ``x`` (the last one padded with
    zeros): the library always sees the same shape, so it takes the same code path and
    reduction order for every row, whatever the number of rows."""
    rows = x.shape[0]
    padded = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])
    tiles = [call(x[i:i + INVARIANT_ROWS]) for i in range(0, padded, INVARIANT_ROWS)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:rows]


def make_ops(kernels_setting: str, device: torch.device, batch_invariant: bool = False) -> TorchOps:
    """``auto``: the native kernels on the CPU where they build, else torch. The
    batch-invariant mode needs the native kernels (the torch path's attention and GEMMs
    change their reduction order with the batch)."""
    if kernels_setting not in ("auto", "native", "torch"):
        raise ValueError(f"unknown kernels {kernels_setting!r}; use auto, native or torch")
    if batch_invariant:
        if kernels_setting == "torch" or device.type != "cpu":
            raise ValueError("batch_invariant needs the native CPU kernels (kernels='native' or "
                             "'auto' on a CPU)")
        if not kernels.available():
            raise ValueError("batch_invariant needs the native CPU kernels, which do not build "
                             "here (see the warning above)")
        return NativeOps(batch_invariant=True)
    if kernels_setting == "torch" or (kernels_setting == "auto" and device.type != "cpu"):
        return TorchOps()
    if device.type != "cpu":
        raise ValueError("the native kernels run on the CPU only; use kernels='torch' or 'auto'")
    if kernels_setting == "native":
        return NativeOps()  # raises with the compiler's message
    return NativeOps() if kernels.available() else TorchOps()
