"""Weight-only quantization of the linear layers: int8 per output channel, int4 group-wise.

The weights stay quantized in memory, in the layout of the engine's own kernel
(``csrc/quant_linear.cpp``: integer dot products, see there), so a decode step streams 1/2 or
1/4 of the bytes of a bf16 weight. Where that kernel does not apply (more than
``QUANT_KERNEL_ROWS`` rows, ``QUANT_KERNEL_ROWS_FLOAT32_GEMM`` on CPUs without a bf16 GEMM, or
no native build) a layer is dequantized and multiplied in the activations' dtype (float32
where there is no bf16 GEMM), or, where there is a bf16 GEMM and room, multiplied by a bf16
copy kept from load (model/native_linear.py). On CPUs without a bf16 GEMM, int8 layers take the W8A8 kernel
(``csrc/quant_w8a8.cpp``, x quantized per row as well) from ``W8A8_ROWS`` rows instead.

- int8: ``w[n, k] ~ q[n, k] * scale[n]``, q in [-127, 127], scale = max |w[n, :]| / 127.
- int4: per group of ``group_size`` inputs, ``w ~ (q - 8) * scale + zero`` with q in [0, 15]
  (asymmetric: scale = (max - min) / 15, zero = min + 8 * scale), which also takes GGUF's Q4_0
  (zero 0) and Q4_1 blocks as they are; or, with the ``e2m1`` codebook (MXFP4 checkpoints,
  kept 4-bit), ``w = (level(q) - 8) * scale + zero`` with the code's fp4 level (``E2M1_LEVELS``:
  twice its value plus 12), scale half the block's power of two and zero = -4 * scale.

Layout (both): output rows in tiles of 64, padded; within a tile, for each step of inputs, 4
vectors of 16 rows whose 32-bit lanes hold consecutive inputs of one row.
- int8 ``packed`` uint8 [N/64, K/4, 4, 64]: ``q + 128`` of inputs k..k+3 (K padded to 128);
- int4 ``packed`` uint8 [N/64, K/8, 4, 64]: byte j of a lane holds input k+j in its low nibble
  and k+4+j in its high one; ``scales_zeros`` [N/64, K/group, 2, 64] in 16 bits: float16 for
  uniform codes (GGUF's Q4_0 / Q4_1 scales are fp16 as they are; 16 bits stream a sixth fewer
  bytes than 32 at groups of 32), bfloat16 for e2m1 ones (powers of two over E8M0's range).

Quantizing works on rows, so a fused weight (QKV, gate/up) is quantized part by part as its
checkpoint tensors stream in (``QuantizedBuilder``), and a tensor-parallel rank quantizes its
own shard; the full-precision weight is never held whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

QuantMethod = Literal["int8", "int4"]
# What an int4 weight's codes stand for; a codebook's index is the kernels' ``codebook`` argument.
Codebook = Literal["uniform", "e2m1"]
CODEBOOKS: tuple[Codebook, ...] = ("uniform", "e2m1")
# e2m1 (fp4) codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated; as levels, 2 * value + 12
# (csrc/quant_common.h holds the same table).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_LEVELS = tuple(int(2 * v + 12) for v in E2M1_VALUES)
INT4_GROUP_SIZES = (32, 64, 128, 256)
# The 16 bits an int4 weight holds its group scales and zeros in (see the module's docstring).
SCALES_ZEROS_DTYPE: dict[str, torch.dtype] = {"uniform": torch.float16, "e2m1": torch.bfloat16}
TILE_ROWS = 64  # output rows of one tile of the packed layouts
INT8_K_BLOCK = 128  # int8 inputs are padded to a multiple of this (the kernel's blocks of x)
QUANT_KERNEL_ROWS = 32  # up to this many rows of x the native kernel beats dequantizing (see native_linear.py)
# The same where the dequantized columns are multiplied in float32 (CPUs without a bf16 GEMM:
# AVX2): the kernel stays ahead to far more rows there (docs/benchmarks.md), but it
# parallelises over tiles of 64 output rows only, so the limit leaves room for machines with
# more cores than a 1024-row layer has tiles.
QUANT_KERNEL_ROWS_FLOAT32_GEMM = 256
# From this many rows of x, int8 weights take the W8A8 kernel (csrc/quant_w8a8.cpp: x
# quantized per row to int8 too, a register-blocked integer GEMM) where it is on: CPUs without
# a bf16 GEMM (AVX2), where it was measured against the kernel above and the float32 GEMM
# (docs/design.md). Fewer rows keep the weight-only kernel, as fast there and more exact.
W8A8_ROWS = 4
# Inputs (padded) up to which its int32 sums cannot overflow: K * 127 * 127 < 2^31.
W8A8_MAX_IN = 131072


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(slots=True)
class Int8Weight:
    packed: torch.Tensor  # uint8 [N/64, K/4, 4, 64], q + 128 (see the module's docstring)
    scales: torch.Tensor  # float32 [N padded to 64]
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    @property
    def packed_in_features(self) -> int:
        """Inputs as packed: padded to INT8_K_BLOCK."""
        return self.packed.shape[1] * 4

    def codes(self) -> torch.Tensor:
        """q, int8 [out, in]."""
        tiles, quads = self.packed.shape[:2]
        u = self.packed.reshape(tiles, quads, 4, 16, 4).permute(0, 2, 3, 1, 4).reshape(tiles * TILE_ROWS,
                                                                                      self.packed_in_features)
        return (u[: self.out_features, : self.in_features].to(torch.int16) - 128).to(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.codes().to(dtype) * self.scales[: self.out_features, None].to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows, any dtype: through the dequantized weight."""
        return F.linear(x, self.dequantize(x.dtype))


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [N/64, K/8, 4, 64] (see the module's docstring)
    scales_zeros: torch.Tensor  # 16-bit [N/64, K/group, 2, 64]: (scale, zero) of each group
    group_size: int
    out_features: int
    in_features: int
    codebook: Codebook = "uniform"

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    @property
    def packed_in_features(self) -> int:
        return self.in_features  # never padded: a multiple of the group

    def codes(self) -> torch.Tensor:
        """q, uint8 in [0, 15], [out, in]."""
        tiles, octets = self.packed.shape[:2]
        p = self.packed.reshape(tiles, octets, 4, 16, 4)
        q = torch.stack([p & 0x0F, p >> 4], dim=4)  # [.., half, j]: input 8 * octet + 4 * half + j
        return q.permute(0, 2, 3, 1, 4, 5).reshape(tiles * TILE_ROWS, octets * 8)[: self.out_features]

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero), float32 [out, in / group]."""
        tiles, groups = self.scales_zeros.shape[:2]
        sz = self.scales_zeros.permute(0, 3, 1, 2).reshape(tiles * TILE_ROWS, groups, 2)[: self.out_features]
        return sz[..., 0].float(), sz[..., 1].float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight it stands for."""
        scale, zero = self.group_params()
        q = int4_levels(self.codes(), self.codebook).reshape(self.out_features, -1, self.group_size)
        w = (q - 8) * scale[..., None] + zero[..., None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows, any dtype: through the dequantized weight."""
        return F.linear(x, self.dequantize(x.dtype))


QuantizedWeight = Int8Weight | Int4Weight


def int4_levels(codes: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """The float32 levels of 4-bit codes (uint8 in [0, 15]) in ``codebook``."""
    if codebook == "uniform":
        return codes.float()
    return torch.tensor(E2M1_LEVELS, dtype=torch.float32)[codes.long()]


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x of any leading shape through the dequantized weight (plain torch), plus the bias."""
    shape = x.shape
    out = weight.linear(x.reshape(-1, shape[-1]).contiguous())
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    return group_size in INT4_GROUP_SIZES and in_features % group_size == 0


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if not int4_shape_ok(out_features, in_features, group_size):
        raise ValueError(f"int4 needs a group size in {INT4_GROUP_SIZES} (got {group_size}) and the input "
                         f"size ({in_features}) a multiple of it")


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """q int8 [out, in] and scale [out] into the kernel's layout."""
    out_f, in_f = q.shape
    n, k = _padded(out_f, TILE_ROWS), _padded(in_f, INT8_K_BLOCK)
    u = torch.full((n, k), 128, dtype=torch.uint8)  # padding: q = 0
    u[:out_f, :in_f] = (q.to(torch.int16) + 128).to(torch.uint8)
    packed = u.reshape(n // TILE_ROWS, 4, 16, k // 4, 4).permute(0, 3, 1, 2, 4).reshape(n // TILE_ROWS, k // 4, 4, 64)
    scales = torch.zeros(n)
    scales[:out_f] = scale.float()
    return Int8Weight(packed.contiguous(), scales, out_f, in_f)


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale float32) of each row of ``w``."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 in [0, 15] [out, in], scale [out, groups], zero [out, groups]) of ``w``."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    # The scale as the weight will hold it (float16), so that the codes are rounded against it.
    scale = ((hi - lo) / 15).clamp(min=2**-24).half().float()
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale, lo + 8 * scale


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              codebook: Codebook = "uniform") -> Int4Weight:
    """Codes uint8 [out, in] in [0, 15], scale and zero [out, in / group] into the kernel's layout."""
    out_f, in_f = q.shape
    n, groups = _padded(out_f, TILE_ROWS), in_f // group_size
    codes = torch.zeros(n, in_f, dtype=torch.uint8)
    codes[:out_f] = q
    c = codes.reshape(n // TILE_ROWS, 4, 16, in_f // 8, 2, 4)  # input 8 * octet + 4 * half + j
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 3, 1, 2, 4).reshape(n // TILE_ROWS, in_f // 8, 4, 64)
    sz = torch.zeros(n, groups, 2, dtype=SCALES_ZEROS_DTYPE[codebook])  # padding rows: scale 0, zero 0
    sz[:out_f, :, 0], sz[:out_f, :, 1] = scale, zero
    scales_zeros = sz.reshape(n // TILE_ROWS, TILE_ROWS, groups, 2).permute(0, 2, 3, 1)
    return Int4Weight(packed.contiguous(), scales_zeros.contiguous(), group_size, out_f, in_f, codebook)


def quantize(w: torch.Tensor, method: QuantMethod, group_size: int = 128) -> QuantizedWeight:
    """A whole weight at once (the streaming loader uses ``QuantizedBuilder``)."""
    builder = QuantizedBuilder(tuple(w.shape), method, group_size)
    builder.write_rows(0, w)
    return builder.finish()


class QuantizedBuilder:
    """A quantized weight filled row block by row block (the parts of a fused weight, or a
    rank's shard), packed once every row is in. An e2m1 one takes MXFP4 blocks only: floats are
    never quantized into fp4 here."""

    def __init__(self, shape: tuple[int, int], method: QuantMethod, group_size: int,
                 codebook: Codebook = "uniform") -> None:
        out_f, in_f = shape
        if method == "int4":
            check_int4_shape(out_f, in_f, group_size)
            groups = in_f // group_size
            self.q = torch.empty(out_f, in_f, dtype=torch.uint8)
            self.scale = torch.empty(out_f, groups)
            self.zero = torch.empty(out_f, groups)
        elif method == "int8":
            self.q = torch.empty(out_f, in_f, dtype=torch.int8)
            self.scale = torch.empty(out_f)
        else:
            raise ValueError(f"unknown quantization {method!r}; use int8 or int4")
        if codebook != "uniform" and (method != "int4" or group_size != GGUF_BLOCK):
            raise ValueError(f"{codebook} weights are int4 in groups of {GGUF_BLOCK}")
        self.method, self.group_size, self.codebook = method, group_size, codebook
        self.rows_written = 0

    def write_rows(self, start: int, rows: torch.Tensor) -> None:
        if self.codebook != "uniform":
            raise ValueError(f"float rows cannot join a weight of {self.codebook} blocks")
        n = rows.shape[0]
        if self.method == "int8":
            q, scale = quantize_int8_rows(rows)
        else:
            q, scale, zero = quantize_int4_rows(rows, self.group_size)
            self.zero[start:start + n] = zero
        self.q[start:start + n] = q
        self.scale[start:start + n] = scale
        self.rows_written += n

    def write_blocks(self, start: int, rows: "BlockQuantized") -> None:
        """Rows of a GGUF tensor: Q4_0/Q4_1/Q4_K into int4 groups of 32 exactly as they are;
        Q8_0/Q6_K into int8 per channel (each row's block scales folded into one: a
        requantization, error at most half a step); any other pairing (say the Q6_K V rows of
        a QKV weight whose Q rows were Q4_K, as Q4_K_M files mix them) through float."""
        n = rows.shape[0]
        if (self.method == "int4" and rows.method == "int4" and self.group_size == GGUF_BLOCK
                and rows.codebook == self.codebook):
            self.q[start:start + n] = rows.codes
            self.scale[start:start + n] = rows.scale
            self.zero[start:start + n] = rows.zero
            self.rows_written += n
        else:
            self.write_rows(start, rows.dequantize())

    @property
    def complete(self) -> bool:
        return self.rows_written == self.q.shape[0]

    def finish(self) -> QuantizedWeight:
        if not self.complete:
            raise ValueError(f"{self.rows_written} of {self.q.shape[0]} rows were written")
        if self.method == "int8":
            return pack_int8(self.q, self.scale)
        return pack_int4(self.q, self.scale, self.zero, self.group_size, self.codebook)


# ---- GGUF blocks kept quantized -----------------------------------------------------------
GGUF_BLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block, and per Q4_K sub-block
GGUF_SUPER = 256  # elements per Q4_K / Q6_K super-block
_INT8_KINDS = ("q8_0", "q6_k")  # into int8 (their block scales folded into one per row)


@dataclass(slots=True)
class BlockQuantized:
    """A GGUF tensor's Q8_0, Q6_K, Q4_0, Q4_1, Q4_K or MXFP4 blocks (or an MXFP4 checkpoint's),
    unpacked but not dequantized: codes and, per block of inputs, a scale (and for the 4-bit
    kinds the int4 layout's zero point). Q4_K's sub-blocks of 32 are int4 groups as they are,
    MXFP4's blocks e2m1 ones; Q6_K's 16-input blocks go into int8 per channel."""

    kind: str  # "q8_0", "q6_k", "q4_0", "q4_1", "q4_k" or "mxfp4"
    # int8 (q8_0, q6_k: w = code * scale) or uint8 in [0, 15] (4-bit: w = (level - 8) * scale + zero)
    codes: torch.Tensor
    scale: torch.Tensor  # float32 [rows, in / block]
    zero: torch.Tensor | None = None  # q4: float32 [rows, in / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def method(self) -> QuantMethod:
        return "int8" if self.kind in _INT8_KINDS else "int4"

    @property
    def codebook(self) -> Codebook:
        return "e2m1" if self.kind == "mxfp4" else "uniform"

    @property
    def block(self) -> int:
        """Inputs per scale."""
        return 16 if self.kind == "q6_k" else GGUF_BLOCK

    def rows(self, order: torch.Tensor | slice) -> "BlockQuantized":
        """These rows (another order: GGUF's rope layout of Q and K; a slice: one expert's)."""
        return BlockQuantized(self.kind, self.codes[order], self.scale[order],
                              None if self.zero is None else self.zero[order])

    def dequantize(self) -> torch.Tensor:
        s = self.scale.repeat_interleave(self.block, dim=1)
        if self.kind in _INT8_KINDS:
            return self.codes.float() * s
        return (int4_levels(self.codes, self.codebook) - 8) * s + self.zero.repeat_interleave(GGUF_BLOCK, dim=1)


def _fp16(raw):
    """Little-endian fp16 bytes [..., 2] as float32 [...]."""
    import numpy as np

    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def mxfp4_blocks(codes: torch.Tensor, exponents: torch.Tensor) -> BlockQuantized:
    """MXFP4: e2m1 codes uint8 [rows, cols] and each block of 32's e8m0 exponent uint8
    [rows, cols / 32] (w = fp4(code) 2^(e - 127)) as e2m1 int4 groups: scale 2^(e - 128),
    zero -4 scale (see the module's docstring); exact in float32."""
    scale = torch.exp2(exponents.float() - 128)
    return BlockQuantized("mxfp4", codes.to(torch.uint8).contiguous(), scale, -4 * scale)


def parse_gguf_blocks(raw, kind: str, rows: int, cols: int) -> BlockQuantized:
    """``raw``: a tensor's bytes, [rows, bytes per row], in ggml's block layouts:
    - Q8_0 (32 inputs): fp16 scale d, 32 int8 codes; w = d q.
    - Q4_0 / Q4_1 (32): fp16 d (Q4_1: then fp16 minimum m), 16 bytes, byte j holding input j
      in its low nibble and j + 16 in its high one; w = d (q - 8), or d q + m.
    - Q4_K (256): fp16 d and dmin, 12 bytes of 6-bit scales and minimums of 8 sub-blocks of 32,
      128 bytes of codes (per 64 inputs, 32 bytes: low nibbles the first 32, high the next);
      w = d sc q - dmin mn per sub-block.
    - Q6_K (256): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales of 16-input
      blocks, fp16 d; w = d sc (q - 32).
    - MXFP4 (32): an e8m0 exponent byte e, then 16 bytes of e2m1 codes as Q4_0 holds its
      codes; w = fp4(q) 2^(e - 127)."""
    import numpy as np

    data = np.asarray(raw, dtype=np.uint8)
    if kind == "mxfp4":
        blocks = data.reshape(rows, cols // GGUF_BLOCK, 17)
        codes = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-1).reshape(rows, cols)
        return mxfp4_blocks(torch.from_numpy(codes), torch.from_numpy(blocks[..., 0].copy()))
    if kind in ("q4_k", "q6_k"):
        return _parse_k_quants(data, kind, rows, cols)
    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[kind]
    payload = GGUF_BLOCK if kind == "q8_0" else GGUF_BLOCK // 2
    blocks = data.reshape(rows, cols // GGUF_BLOCK, head + payload)
    d = _fp16(blocks[..., :2])
    data = blocks[..., head:]
    if kind == "q8_0":
        codes = data.copy().view(np.int8).reshape(rows, cols)
        return BlockQuantized(kind, torch.from_numpy(codes), torch.from_numpy(d))
    codes = np.concatenate([data & 0x0F, data >> 4], axis=-1).reshape(rows, cols)
    if kind == "q4_0":  # w = d * (q - 8)
        zero = np.zeros_like(d)
    else:  # q4_1: w = d * q + m = (q - 8) * d + (m + 8 d)
        m = _fp16(blocks[..., 2:4])
        zero = m + 8 * d
    return BlockQuantized(kind, torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zero))


def _parse_k_quants(data, kind: str, rows: int, cols: int) -> BlockQuantized:
    """Q4_K / Q6_K super-blocks (see parse_gguf_blocks)."""
    import numpy as np

    supers = cols // GGUF_SUPER
    b = data.reshape(rows, supers, -1)
    if kind == "q4_k":
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        packed = b[..., 4:16].reshape(rows, supers, 3, 4)  # 6-bit scales and minimums
        lo, mid, hi = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
        mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1).astype(np.float32)
        qs = b[..., 16:].reshape(rows, supers, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)  # (chunk, half, j)
        scale = (d[..., None] * sc).reshape(rows, -1)  # exact in float32
        zero = 8 * scale - (dmin[..., None] * mn).reshape(rows, -1)  # w = (q - 8) scale + zero
        return BlockQuantized(kind, torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(scale),
                              torch.from_numpy(zero.astype(np.float32)))
    ql, qh = b[..., :128].reshape(rows, supers, 2, 1, 64), b[..., 128:192].reshape(rows, supers, 2, 1, 32)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [.., half, 2, 64]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03  # [.., half, 4, 32]
    q = low.reshape(rows, supers, 2, 4, 32) | (high << 4)
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
    scale = b[..., 192:208].copy().view(np.int8).astype(np.float32) * _fp16(b[..., 208:210])[..., None]
    return BlockQuantized(kind, torch.from_numpy(codes), torch.from_numpy(scale.reshape(rows, -1)))
