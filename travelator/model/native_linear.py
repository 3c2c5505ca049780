"""The linear layers of ``NativeOps``: y = x W^T (+ bias), each weight's route decided once.

``prepare`` gives every bf16 CPU weight its route (``LinearRoute``) and the copy that route
multiplies: laid out in blocks of 64 columns for travelator's own ``blocked_linear`` on CPUs
with AVX512-BF16 (on AMX's tiles where there are, for inputs a multiple of 32; faster than
oneDNN at a decode step's rows), pre-packed for oneDNN elsewhere (so no linear layer reorders
its weight at every call), and on AVX2 CPUs,
where oneDNN has no bf16 GEMM, laid out in panels of 16 columns for travelator's own
``panel_linear`` (float32 sums over the bf16 weight; widened to float32 and packed for oneDNN
where that kernel is not built or the columns do not divide). A float32 weight is packed for
oneDNN's float32 GEMM. A call only follows the route; within the oneDNN routes, steps of a
few rows stream the natural-layout weight through ``small_m_linear`` instead (``panel_linear``
streams its panels at those rows itself). Quantized weights take their own kernel up to ``quant_kernel_rows`` rows; past
that, where there is a bf16 GEMM and memory allows, a bf16 copy made once at load (laid out
as a bf16 weight's route would be), else the weight dequantized at every call; where there is
no bf16 GEMM (AVX2), int8 weights take the W8A8 kernel from ``W8A8_ROWS`` rows instead. The native layer stack reads the same routes
(``streaming_linear``).

With ``batch_invariant`` every row's numbers are independent of the other rows of the step:
the native kernels already compute each row on its own, and the GEMMs always run in tiles of
exactly ``INVARIANT_ROWS`` rows (the last one padded), so the GEMM library sees one shape and
takes one code path whatever the batch (see docs/design.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from travelator.model.host_memory import available_bytes
from travelator.model.linear_route import LinearRoute
from travelator.model.quant import (
    CODEBOOKS,
    QUANT_KERNEL_ROWS,
    QUANT_KERNEL_ROWS_FLOAT32_GEMM,
    TILE_ROWS,
    W8A8_MAX_IN,
    W8A8_ROWS,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantized_linear,
)

# Rows of every GEMM call in batch-invariant mode.
INVARIANT_ROWS = 64
# Tiles of 64 output rows a quantized layer is dequantized in at a time (past the kernel's rows).
DEQUANT_TILES = 32
# Past the integer kernel's rows, the GEMM over a kept bf16 copy beats dequantizing at every
# call (docs/benchmarks.md): quantized weights keep one where all the copies together take at
# most this share of the memory available once the weights are loaded.
GEMM_COPY_MEMORY_SHARE = 0.25
# Rows of x up to which a quantized layer takes the integer kernel where it keeps a copy: where
# every copy is blocked_linear's (the layer stack runs them), else (oneDNN's, Python layers).
QUANT_KERNEL_ROWS_BESIDE_BLOCKED_COPY = 8
QUANT_KERNEL_ROWS_BESIDE_COPY = 16
# Output columns of a block of a blocked_linear weight (csrc/blocked_linear.cpp).
BLOCK_COLUMNS = 64
# Output columns of a panel of a panel_linear weight (csrc/panel_linear.cpp).
PANEL_COLUMNS = 16

Rows = Callable[[torch.Tensor], torch.Tensor]


def blocked_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 64, K / 2, 64, 2]: for each 64 output columns, every pair of k in order,
    the columns' two weights side by side (the layout of csrc/blocked_linear.cpp)."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK_COLUMNS, BLOCK_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16]: for each 16 output columns, every k in order, the columns'
    weights side by side (the layout of csrc/panel_linear.cpp)."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k).transpose(1, 2).contiguous()


@dataclass(frozen=True, slots=True)
class PreparedLinear:
    """A bf16 or float32 weight as loaded, its route, and the copy that route multiplies."""

    route: LinearRoute
    weight: torch.Tensor  # natural [N, K] layout: small_m_linear streams it (not on PANELS)
    copy: torch.Tensor  # blocked_linear's or panel_linear's layout, or oneDNN-packed (bf16 or float32)


@dataclass(frozen=True, slots=True)
class StreamingLinear:
    """A linear layer as the native layer stack (model/layer_stack.py) calls it: its route
    (``csrc/linear_route.h``), its tensors, and its output features."""

    route: LinearRoute
    a: torch.Tensor
    b: torch.Tensor | None
    bias: torch.Tensor | None
    group: int
    out_features: int

    @property
    def quantized(self) -> bool:
        """Whether its rows are bounded by the quantized kernel's (``streaming_rows``)."""
        return self.route.quantized

    @property
    def row_kind(self) -> tuple[bool, bool, bool]:
        """(quantized, int8, blocked): the arguments of ``streaming_rows`` that bound its rows."""
        return self.quantized, self.route is LinearRoute.INT8, self.route is LinearRoute.BLOCKED


@dataclass(slots=True)
class StreamingLinears:
    """Linear layers in the encoding the native calls read (csrc/streaming_linear.h): layer i
    is entries 3i..3i+2 of ``tensors`` (a, b, bias) and of ``ints`` (route, group, out
    features); ``row_kinds``: the kinds of weights held, (quantized, int8, blocked), as
    ``streaming_rows`` takes them (their row limits differ)."""

    tensors: list[torch.Tensor | None] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    row_kinds: set[tuple[bool, bool, bool]] = field(default_factory=set)

    def append(self, spec: StreamingLinear) -> None:
        self.tensors += [spec.a, spec.b, spec.bias]
        self.ints += [int(spec.route), spec.group, spec.out_features]
        self.row_kinds.add(spec.row_kind)


class NativeLinear:
    """y = x W^T (+ bias) on the native kernels, by the route ``prepare`` gave each weight."""

    def __init__(self, batch_invariant: bool, bf16_gemm: bool | None) -> None:
        """bf16_gemm: whether bf16 weights go to oneDNN's bf16 GEMM; None: where this CPU has
        one. False takes the widened float32 route of AVX2 machines (tests take it anywhere)."""
        self._ops = torch.ops.travelator
        self._batch_invariant = batch_invariant
        # Weight -> its route and copy (bf16 weights on the CPU only).
        self._prepared: dict[torch.Tensor, PreparedLinear] = {}
        # Bias -> its float32 copy for the widened route, made at its first call (prepare sees
        # the weights only), so a biased layer does not convert its bias at every call.
        self._widened_biases: dict[torch.Tensor, torch.Tensor] = {}
        self._blocked_built = hasattr(self._ops, "blocked_linear")  # AVX512-BF16
        # With AMX blocked_linear runs on the tiles where k is a multiple of this (0: no AMX
        # here, or Linux refused the tiles, when oneDNN cannot use them either and the BLOCKED
        # route takes its vdpbf16ps kernel as on CPUs without AMX); with the tiles, weights of other k
        # keep oneDNN's route, faster than that kernel on AMX.
        self.blocked_on_tiles = self._ops.blocked_linear_amx_k_multiple() if self._blocked_built else 0
        self._panels_built = hasattr(self._ops, "panel_linear")  # AVX2 without AVX-512
        # Built where the compiler targets AVX512-BF16 or AVX2. A second code path chosen by
        # the row count would make a row's numbers depend on the batch: off when invariant.
        self._small_m_built = not batch_invariant and hasattr(self._ops, "small_m_linear")
        # Rows of x up to which it is faster than the GEMM library.
        self._small_m_rows = self._ops.small_m_linear_rows() if self._small_m_built else 0
        # The integer kernels' rows do not depend on each other: on when batch-invariant too.
        self._quant_kernel_built = hasattr(self._ops, "quant_linear_int8")  # AVX512-VNNI or AVX2
        self._quant_dequantize_built = hasattr(self._ops, "quant_dequantize_int8")  # AVX512-BW or AVX2
        # Past quant_kernel_rows rows a quantized layer is dequantized, DEQUANT_TILES tiles of
        # output rows at a time, into this buffer (kept: a fresh one would cost its page faults
        # at every call; bounded: at most DEQUANT_TILES * 64 columns of the weight).
        self._dequantized = torch.empty(0)
        # Quantized weight (its packed codes) -> its bf16 copy for the GEMM, laid out for its
        # route; made by prepare where there is room (``gemm_copies``).
        self._gemm_copies: dict[torch.Tensor, PreparedLinear] = {}
        # Why quantized weights keep no bf16 copy ("": they do, or there are none).
        self.gemm_copies_refused = ""
        if bf16_gemm is None:
            bf16_gemm = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        # Without a bf16 GEMM torch's bf16 matmul is far slower than float32's: bf16 weights and
        # dequantized columns are multiplied in float32 instead. The products of bf16 numbers
        # are exact in float32, so this is a bf16 GEMM with float32 sums, as oneDNN's is.
        self._bf16_gemm = bf16_gemm
        # Rows of x up to which a quantized layer takes the integer kernel (any, when invariant).
        self.quant_kernel_rows = QUANT_KERNEL_ROWS if bf16_gemm else QUANT_KERNEL_ROWS_FLOAT32_GEMM
        # Rows of x from which an int8 layer takes the W8A8 kernel (0: never). On where it was
        # measured faster: without a bf16 GEMM. Its rows never depend on each other, but a
        # second kernel chosen by the row count would make them depend on the batch: when
        # invariant it takes every row count.
        w8a8 = hasattr(self._ops, "quant_linear_w8a8") and not bf16_gemm
        self.w8a8_rows = (1 if batch_invariant else W8A8_ROWS) if w8a8 else 0

    def prepare(self, weights: Iterable[torch.Tensor | QuantizedWeight], activations: torch.dtype,
                gemm_copies: bool = True) -> None:
        """activations: the dtype of the x the weights will be given (bf16 copies serve bf16 x);
        gemm_copies: whether quantized weights may keep one (``_prepare_gemm_copies``)."""
        if not torch.backends.mkldnn.is_available():
            return
        weights = list(weights)
        if activations == torch.bfloat16 and gemm_copies:
            self._prepare_gemm_copies([w for w in weights if isinstance(w, (Int8Weight, Int4Weight))])
        for w in weights:
            if not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.dim() != 2:
                continue
            if w.dtype == torch.bfloat16:
                self._prepared[w] = self._prepare_bf16(w)
            elif w.dtype == torch.float32:
                # Packed once: F.linear would reorder the natural layout at every call.
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                self._prepared[w] = PreparedLinear(LinearRoute.ONEDNN_FLOAT32, w, packed)

    def _prepare_gemm_copies(self, quantized: list[QuantizedWeight]) -> None:
        """A bf16 copy of every quantized weight for the GEMM past the integer kernel's rows,
        or of none: where there is a bf16 GEMM, the rows are not invariant (then the kernel
        takes every count) and all the copies fit ``GEMM_COPY_MEMORY_SHARE`` of the memory."""
        if (not quantized or not self._bf16_gemm or self._batch_invariant or not self._quant_kernel_built
                or not self._quant_dequantize_built):
            return
        needed = sum(2 * w.out_features * w.in_features for w in quantized)
        available = available_bytes()
        if available is None or needed > GEMM_COPY_MEMORY_SHARE * available:
            free = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
            self.gemm_copies_refused = (f"their bf16 copies would take {needed / 2**30:.1f} GiB, more than "
                                        f"{GEMM_COPY_MEMORY_SHARE:.0%} of the memory available ({free})")
            return
        copies = [self._prepare_bf16(self._dequantized_bf16(w)) for w in quantized]
        self._gemm_copies |= {w.packed: copy for w, copy in zip(quantized, copies)}
        # With a copy at hand the GEMM beats the integer kernel from fewer rows; fewer still where
        # the copies run in the layer stack.
        blocked = all(copy.route is LinearRoute.BLOCKED for copy in self._gemm_copies.values())
        beside = QUANT_KERNEL_ROWS_BESIDE_BLOCKED_COPY if blocked else QUANT_KERNEL_ROWS_BESIDE_COPY
        self.quant_kernel_rows = min(self.quant_kernel_rows, beside)

    def _dequantized_bf16(self, w: QuantizedWeight) -> torch.Tensor:
        """The bf16 weight [N, K], by the kernels that dequantize per call: the same values."""
        tiles = w.packed.shape[0]
        wt = torch.empty(w.packed_in_features, tiles * TILE_ROWS, dtype=torch.bfloat16)  # W^T
        self._dequantize_tiles(w, 0, tiles, wt)
        return wt[: w.in_features, : w.out_features].t().contiguous()

    def _dequantize_tiles(self, w: QuantizedWeight, t0: int, t1: int, w_t: torch.Tensor) -> None:
        """Tiles [t0, t1) of the weight's output rows, dequantized into w_t ([K, their rows]: W^T)."""
        if isinstance(w, Int8Weight):
            self._ops.quant_dequantize_int8(w.packed[t0:t1], w.scales[t0 * TILE_ROWS:t1 * TILE_ROWS], w_t)
        else:
            self._ops.quant_dequantize_int4(w.packed[t0:t1], w.scales_zeros[t0:t1], w.group_size, w_t,
                                            CODEBOOKS.index(w.codebook))

    @property
    def gemm_copies(self) -> bool:
        """Whether quantized weights past the integer kernel's rows take a kept bf16 copy."""
        return bool(self._gemm_copies)

    def _prepare_bf16(self, w: torch.Tensor) -> PreparedLinear:
        n, k = w.shape
        if self._bf16_gemm and self._blocked_built and n % BLOCK_COLUMNS == 0 and k % (self.blocked_on_tiles or 2) == 0 and k > 0:
            return PreparedLinear(LinearRoute.BLOCKED, w, blocked_linear_weight(w))
        if self._bf16_gemm:
            return PreparedLinear(LinearRoute.ONEDNN_BF16, w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        # The bf16 weight (the model's own tensor) stays beside its panels or float32 copy.
        if self._panels_built and n % PANEL_COLUMNS == 0 and k > 0:
            return PreparedLinear(LinearRoute.PANELS, w, panel_linear_weight(w))
        wide = torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), None)
        return PreparedLinear(LinearRoute.ONEDNN_FLOAT32, w, wide)

    def route(self, weight: torch.Tensor | QuantizedWeight) -> LinearRoute | None:
        """The weight's route; None for a weight that runs as loaded, through F.linear."""
        if not isinstance(weight, torch.Tensor):
            return _quantized_route(weight)
        prepared = self._prepared.get(weight)
        return None if prepared is None else prepared.route

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):
            return self._quantized(x, weight, bias)
        prepared = self._prepared.get(weight)
        if prepared is None:
            return self._gemm(partial(_plain_gemm, weight, bias), x)
        if prepared.route is LinearRoute.BLOCKED:
            return self._gemm(partial(_over_rows, partial(_blocked_gemm, prepared.copy, bias)), x)
        if prepared.route is LinearRoute.PANELS:
            # Each row's sums follow k in order alone: invariant without fixed tiles. A few rows
            # stream the panels, faster than small_m_linear over the natural layout.
            return _over_rows(partial(self._ops.panel_linear, w=prepared.copy, bias=bias), x)
        if (self._small_m_built and bias is None and x.dim() == 2 and x.shape[0] <= self._small_m_rows
                and x.dtype == torch.bfloat16):
            # A few rows only stream the weights: read in their natural layout.
            return self._ops.small_m_linear(x.contiguous(), weight)
        if prepared.route is LinearRoute.ONEDNN_FLOAT32:
            return self._gemm(partial(_widened_gemm, prepared.copy, self._widened_bias(bias)), x)
        return self._gemm(partial(_onednn_gemm, prepared.copy, bias), x)

    def streaming_linear(self, weight: torch.Tensor | QuantizedWeight,
                         bias: torch.Tensor | None) -> StreamingLinear | None:
        """How the native layer stack calls this layer (None: it cannot): the route ``__call__``
        takes at up to ``streaming_rows`` rows."""
        if not isinstance(weight, torch.Tensor):
            if not self._quant_kernel_built:
                return None
            if isinstance(weight, Int8Weight):
                return StreamingLinear(LinearRoute.INT8, weight.packed, weight.scales, bias, 0, weight.out_features)
            return StreamingLinear(_quantized_route(weight), weight.packed, weight.scales_zeros, bias,
                                   weight.group_size, weight.out_features)
        prepared = self._prepared.get(weight)
        if prepared is None or not self._small_m_built or weight.dtype != torch.bfloat16:
            return None  # small_m_linear streams bf16 weights only
        if prepared.route in (LinearRoute.BLOCKED, LinearRoute.PANELS):  # their kernels take the copy and a bias
            return StreamingLinear(prepared.route, prepared.copy, None, bias, 0, weight.shape[0])
        if bias is not None:  # small_m_linear takes no bias: the GEMM does
            return None
        return StreamingLinear(prepared.route, weight, None, None, 0, weight.shape[0])

    def streaming_copy(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> StreamingLinear | None:
        """How the native layer stack calls a quantized layer past the integer kernel's rows:
        its kept bf16 copy on the BLOCKED route, as ``__call__`` takes it there (None: it keeps
        no copy, or the copy is oneDNN's)."""
        copy = None if isinstance(weight, torch.Tensor) else self._gemm_copies.get(weight.packed)
        if copy is None or copy.route is not LinearRoute.BLOCKED:
            return None
        return StreamingLinear(LinearRoute.BLOCKED, copy.copy, None, bias, 0, weight.out_features)

    def streaming_rows(self, quantized: bool, int8: bool = False, blocked: bool = False) -> int:
        """The most rows of x for which ``__call__`` takes the streaming kernel that
        ``streaming_linear`` names (0: none); int8: for an int8 weight (W8A8 above); blocked:
        for a weight on the BLOCKED route, whose kernel takes every row count."""
        if blocked:
            return sys.maxsize if self._blocked_built else 0
        if not quantized:
            return self._small_m_rows
        if not self._quant_kernel_built:
            return 0
        rows = sys.maxsize if self._batch_invariant else self.quant_kernel_rows
        return min(rows, self.w8a8_rows - 1) if int8 and self.w8a8_rows else rows

    def _gemm(self, call: Rows, x: torch.Tensor) -> torch.Tensor:
        return _in_fixed_tiles(call, x) if self._batch_invariant else call(x)

    def _widened_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        if bias is None:
            return None
        wide = self._widened_biases.get(bias)
        if wide is None:
            wide = self._widened_biases[bias] = bias.detach().float()
        return wide

    def _quantized(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """int8 from w8a8_rows rows (where on): the W8A8 kernel. Else up to quant_kernel_rows
        rows, the engine's integer kernel, which streams the quantized bytes; its rows never
        depend on each other, so batch-invariant mode takes it for any count. More rows: the GEMM
        over the weight's kept bf16 copy where prepare made one (bf16 x), else the weight
        dequantized, then the GEMM of x's dtype (oneDNN; float32 where there is no bf16 GEMM)."""
        native = x.dtype in (torch.bfloat16, torch.float32)
        n_rows = x.shape[0] if x.dim() == 2 else x.shape[:-1].numel()
        if native and self.w8a8_rows and n_rows >= self.w8a8_rows and _w8a8_fits(weight):
            return _over_rows(partial(self._w8a8, weight, self._widened_bias(bias)), x)
        if native and self._quant_kernel_built and (self._batch_invariant or n_rows <= self.quant_kernel_rows):
            out = _over_rows(partial(self._integer_kernel, weight), x)
            return out if bias is None else out + bias
        copy = self._gemm_copies.get(weight.packed) if x.dtype == torch.bfloat16 else None
        if copy is not None:
            gemm = _blocked_gemm if copy.route is LinearRoute.BLOCKED else _onednn_gemm
            return _over_rows(partial(gemm, copy.copy, bias), x)
        if native and self._quant_dequantize_built:
            return self._gemm(partial(self._dequantized_linear, weight=weight, bias=bias), x)
        # No native build, or float16: torch dequantizes the whole weight every call.
        return self._gemm(partial(quantized_linear, weight=weight, bias=bias), x)

    def _w8a8(self, weight: Int8Weight, wide_bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        return self._ops.quant_linear_w8a8(rows, weight.packed, weight.scales, wide_bias, weight.out_features)

    def _integer_kernel(self, weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return self._ops.quant_linear_int8(rows, weight.packed, weight.scales, weight.out_features)
        return self._ops.quant_linear_int4(rows, weight.packed, weight.scales_zeros, weight.group_size,
                                           weight.out_features, CODEBOOKS.index(weight.codebook))

    def _dequantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
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
            self._dequantize_tiles(weight, t0, t1, w_t)
            n0, n1 = t0 * TILE_ROWS, min(weight.out_features, t1 * TILE_ROWS)
            out[:, n0:n1] = rows @ w_t[: weight.in_features, : n1 - n0]
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], weight.out_features)


def _quantized_route(weight: QuantizedWeight) -> LinearRoute:
    if isinstance(weight, Int8Weight):
        return LinearRoute.INT8
    return LinearRoute.INT4_FP4 if weight.codebook == "e2m1" else LinearRoute.INT4


def _w8a8_fits(weight: QuantizedWeight) -> bool:
    """An int8 weight whose inputs the W8A8 kernel's int32 sums can hold."""
    return isinstance(weight, Int8Weight) and weight.packed_in_features <= W8A8_MAX_IN


def _plain_gemm(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, weight, bias)


def _blocked_gemm(blocked: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.travelator.blocked_linear(rows, blocked, bias)


def _onednn_gemm(packed: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _widened_gemm(wide: torch.Tensor, wide_bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.float(), wide, wide_bias, "none", [], "").to(rows.dtype)


def _over_rows(kernel: Rows, x: torch.Tensor) -> torch.Tensor:
    """A native linear kernel, which takes contiguous 2-D rows, over x of any leading shape.
    A 2-D contiguous x (the model's case) skips the reshapes, which would cost a quantized
    layer's call a large share of its time."""
    if x.dim() == 2 and x.is_contiguous():
        return kernel(x)
    out = kernel(x.reshape(-1, x.shape[-1]).contiguous())
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _in_fixed_tiles(call: Rows, x: torch.Tensor) -> torch.Tensor:
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
