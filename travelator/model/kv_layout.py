"""How the KV cache stores a token's keys and values.

Each layer has one K and one V tensor, [blocks, kv_heads, block_size, row]: a row is one
head's vector for one token. A block holds each head's rows together, so that attention,
which reads one head's keys in order of position, reads memory front to back: the hardware
prefetchers then run ahead of it (docs/design.md, "The KV cache's rows"; csrc/kv_layout.h
states the same layout for the kernels). In a float dtype (the model's, or another one) the
row is the head_dim values themselves. With ``kv_cache_dtype="int8"`` the row is head_dim signed
8-bit codes followed by their float32 scale (its 4 bytes, bit-cast):

    scale = max|x| / 127,    code = round(x * (127 / max|x|)) in [-127, 127],    x ~ code * scale

one scale per token and head, so a block never needs requantizing as it fills, and one
outlier spoils only its own row. head_dim + 4 bytes a row: at head_dim 64, 68 bytes against
128 in bf16, so the pool holds 1.9x the tokens (3.8x against float32), and attention reads
about half the bytes. The native kernels write
(``write_kv_``) and read (``paged_attention``) this format in C++; the functions here are
the torch form, used by the fallback path and as the tests' reference.
"""

from __future__ import annotations

import torch

# Bytes of the float32 scale at the end of an int8 row.
INT8_SCALE_BYTES = 4
# The largest code: symmetric, so that -x stores as exactly -code.
INT8_MAX_CODE = 127


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one cache row (one token, one head)."""
    return head_dim + INT8_SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                kv_dtype: torch.dtype) -> tuple[int, int, int, int]:
    return (num_blocks, kv_heads, block_size, row_width(head_dim, kv_dtype))


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows [T, kv_heads, row] into their slots [T] (slot = block * block_size + position)."""
    block_size = cache.shape[2]
    cache[slots // block_size, :, slots % block_size] = rows


def gather_positions(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks of block_tables [..., n] as [..., kv_heads, n * block_size, row]: each
    head's rows in order of position."""
    _, kv_heads, block_size, row = cache.shape
    # index_select on the flat block list is faster than advanced indexing on CPU.
    g = cache.index_select(0, block_tables.reshape(-1))  # [N * n, kv_heads, block_size, row]
    g = g.view(*block_tables.shape, kv_heads, block_size, row).movedim(-3, -4)
    return g.reshape(*block_tables.shape[:-1], kv_heads, block_tables.shape[-1] * block_size, row)


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in every layer."""
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * num_layers * kv_heads * row_width(head_dim, kv_dtype) * itemsize


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows (codes, then the scale's bytes). A row with
    a NaN or an infinity keeps a NaN scale, so that it reads back as NaN, never as a
    plausible number."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    # Divisions of tensor by tensor: torch turns 127 / t into reciprocal(t) * 127, which
    # rounds differently from the C++ writer's division.
    top = torch.full_like(amax, INT8_MAX_CODE)
    scale = torch.where(finite, amax / top, torch.full_like(amax, float("nan")))
    inv = top / amax
    # All zeros, or so tiny (below ~4e-37) that 127 / max|x| overflows: codes 0.
    inv = torch.where(finite & torch.isfinite(inv), inv, torch.zeros_like(amax))
    codes = torch.round(torch.where(finite, xf, torch.zeros_like(xf)) * inv).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8).reshape(*scale.shape[:-1], INT8_SCALE_BYTES)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] of ``dtype``."""
    codes, scale_bytes = rows[..., :-INT8_SCALE_BYTES], rows[..., -INT8_SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
