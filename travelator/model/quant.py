"""Weight-only quantization of the linear layers: int8 per output channel, int4 group-wise.

The weights stay quantized in memory and in the matrix product: torch's own CPU kernels
multiply bf16/fp32 activations by them (``aten._weight_int8pack_mm``, and the tinygemm-style
``aten._weight_int4pack_mm_for_cpu`` on a packed int4 layout), so a step streams 1/2 or 1/4
of the bytes of a bf16 weight.

- int8: ``w[n, k] ~ q[n, k] * scale[n]``, q in [-127, 127], scale = max |w[n, :]| / 127.
- int4: per group of ``group_size`` inputs, ``w ~ (q - 8) * scale + zero`` with q in [0, 15]
  (asymmetric: scale = (max - min) / 15, zero = min + 8 * scale), the convention of the int4
  kernel, which also takes GGUF's Q4_0 (zero 0) and Q4_1 blocks as they are.

Quantizing works on rows, so a fused weight (QKV, gate/up) is quantized part by part as its
checkpoint tensors stream in (``QuantizedBuilder``), and a tensor-parallel rank quantizes its
own shard; the full-precision weight is never held whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

QuantMethod = Literal["int8", "int4"]
INT4_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 2  # the int4 kernel's packing (its K must be a multiple of 16 * this)


@dataclass(slots=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], the activations' dtype

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8, the int4 kernel's layout
    scales_zeros: torch.Tensor  # [in / group, out, 2] (scale, zero), the activations' dtype
    group_size: int
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """The float weight it stands for (tests, and the reference of the accuracy checks)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return self.linear(eye).float().T.contiguous()


QuantizedWeight = Int8Weight | Int4Weight


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    return (group_size in INT4_GROUP_SIZES and in_features % group_size == 0
            and in_features % (16 * _INNER_K_TILES) == 0 and out_features % 16 == 0)


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if not int4_shape_ok(out_features, in_features, group_size):
        raise ValueError(f"int4 needs a group size in {INT4_GROUP_SIZES} (got {group_size}), the input size "
                         f"({in_features}) a multiple of it and of {16 * _INNER_K_TILES}, and the output "
                         f"size ({out_features}) a multiple of 16")


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
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale, lo + 8 * scale


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> Int4Weight:
    out_f, in_f = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INNER_K_TILES)
    scales_zeros = torch.stack([scale.T, zero.T], dim=-1).to(dtype).contiguous()
    return Int4Weight(packed, scales_zeros, group_size, out_f, in_f)


def quantize(w: torch.Tensor, method: QuantMethod, dtype: torch.dtype, group_size: int = 128) -> QuantizedWeight:
    """A whole weight at once (the streaming loader uses ``QuantizedBuilder``)."""
    builder = QuantizedBuilder(tuple(w.shape), method, dtype, group_size)
    builder.write_rows(0, w)
    return builder.finish()


class QuantizedBuilder:
    """A quantized weight filled row block by row block (the parts of a fused weight, or a
    rank's shard), packed once every row is in."""

    def __init__(self, shape: tuple[int, int], method: QuantMethod, dtype: torch.dtype, group_size: int) -> None:
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
        self.method, self.dtype, self.group_size = method, dtype, group_size
        self.rows_written = 0

    def write_rows(self, start: int, rows: torch.Tensor) -> None:
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
        """Rows of a GGUF tensor: Q4_0/Q4_1 into int4 groups of 32 exactly as they are; Q8_0
        into int8 per channel (each row's block scales folded into one: a requantization,
        error at most half a step); any other pairing through float."""
        n = rows.shape[0]
        if self.method == "int4" and rows.kind != "q8_0" and self.group_size == GGUF_BLOCK:
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
            return Int8Weight(self.q, self.scale.to(self.dtype))
        return pack_int4(self.q, self.scale, self.zero, self.group_size, self.dtype)


# ---- GGUF blocks kept quantized -----------------------------------------------------------
GGUF_BLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block


@dataclass(slots=True)
class BlockQuantized:
    """A GGUF tensor's Q8_0, Q4_0 or Q4_1 blocks, unpacked but not dequantized: codes and, per
    block of 32 inputs, a scale (and for Q4 the int4 kernel's zero point)."""

    kind: str  # "q8_0", "q4_0" or "q4_1"
    codes: torch.Tensor  # int8 (q8_0: w = code * scale) or uint8 in [0, 15] (q4: w = (code - 8) * scale + zero)
    scale: torch.Tensor  # float32 [rows, in / 32]
    zero: torch.Tensor | None = None  # q4: float32 [rows, in / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def method(self) -> QuantMethod:
        return "int8" if self.kind == "q8_0" else "int4"

    def rows(self, order: torch.Tensor) -> "BlockQuantized":
        """The same rows in another order (GGUF's rope layout of Q and K)."""
        return BlockQuantized(self.kind, self.codes[order], self.scale[order],
                              None if self.zero is None else self.zero[order])

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        s = self.scale.repeat_interleave(GGUF_BLOCK, dim=1)
        if self.kind == "q8_0":
            return self.codes.float() * s
        return (self.codes.float() - 8) * s + self.zero.repeat_interleave(GGUF_BLOCK, dim=1)


def parse_gguf_blocks(raw, kind: str, rows: int, cols: int) -> BlockQuantized:
    """``raw``: a Q8_0 / Q4_0 / Q4_1 tensor's bytes, [rows, bytes per row] (ggml's layout: per
    block an fp16 scale d, for Q4_1 an fp16 minimum m, then the codes; a Q4 block's byte j
    holds element j in its low nibble and element j + 16 in its high one)."""
    import numpy as np

    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[kind]
    payload = GGUF_BLOCK if kind == "q8_0" else GGUF_BLOCK // 2
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GGUF_BLOCK, head + payload)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    data = blocks[..., head:]
    if kind == "q8_0":
        codes = data.copy().view(np.int8).reshape(rows, cols)
        return BlockQuantized(kind, torch.from_numpy(codes), torch.from_numpy(d))
    codes = np.concatenate([data & 0x0F, data >> 4], axis=-1).reshape(rows, cols)
    if kind == "q4_0":  # w = d * (q - 8)
        zero = np.zeros_like(d)
    else:  # q4_1: w = d * q + m = (q - 8) * d + (m + 8 d)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return BlockQuantized(kind, torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zero))
