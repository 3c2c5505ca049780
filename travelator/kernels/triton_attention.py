"""Paged attention for GPUs, in Triton: one call per layer for the whole flat batch.

Decodes and prefill chunks of any length mixed, as the CPU kernel takes them
(``model/attention.py``'s metadata): ``query_start`` [B + 1] rows of each request in ``q``,
``seq_lens`` [B] tokens cached once this step's are written, ``block_tables`` [B, W]. Keys
and values are read in place from the paged cache [blocks, KV heads, block_size, D] through
the block tables, never gathered into a padded copy.

The grid is (query tiles, KV heads, key splits). A query tile holds up to ``BLOCK_Q`` rows
of one request times the query heads that share one KV head (GQA), so a tile's keys are
loaded once for the whole group. Request r's tiles are numbered from
``query_start[r] // BLOCK_Q + r``: a program finds its request by binary search over those
starts, with no host-built map. Keys are visited in tiles of ``BLOCK_N`` absolute positions
with an online softmax in float32. A decode-only step over long contexts also splits each
request's keys into segments of ``KEYS_PER_SPLIT`` positions, one program each, merged by a
second kernel: with one query row per request the grid would otherwise hold too few programs
to fill the GPU.

A sliding window (Mistral, Gemma 3's local layers) narrows each row's keys as transformers
does: the query at position p sees keys p - window + 1 .. p; tiles wholly before a tile's
first visible key are not read.

Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (the tests check them there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
KEYS_PER_SPLIT = 512  # key positions per program of a split decode step
BLOCK_N = 32  # key positions per inner tile
_MIN_ROWS = 16  # tl.dot's smallest tile


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _request_of_tile(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The request whose tiles include ``tile``: the last r with query_start[r] // BLOCK_Q + r <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
    scale, num_seqs, window, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cs, stride_bt,
    tiles_per_split,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = _request_of_tile(query_start_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + r)
    q_end = tl.load(query_start_ptr + r + 1)
    q_first = q_begin + (tile - (q_begin // BLOCK_Q + r)) * BLOCK_Q
    if q_first < q_end:
        context = tl.load(seq_lens_ptr + r) - (q_end - q_begin)  # position of row q_begin

        m = tl.arange(0, BLOCK_M)
        row = q_first + m // GROUP
        head = kv_head * GROUP + m % GROUP
        row_ok = (m // GROUP < BLOCK_Q) & (row < q_end)
        q_pos = context + row - q_begin
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)

        # The tile's keys: from the first any of its rows sees to its last row's position.
        first_key = tl.where(window > 0, tl.maximum(context + q_first - q_begin - window + 1, 0), 0)
        end_key = context + tl.minimum(q_first + BLOCK_Q, q_end) - q_begin
        t_lo = tl.maximum(first_key // BLOCK_N, split * tiles_per_split)
        t_hi = tl.minimum(tl.cdiv(end_key, BLOCK_N), (split + 1) * tiles_per_split)

        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for t in range(t_lo, t_hi):
            k_pos = t * BLOCK_N + n
            k_ok = k_pos < end_key
            block = tl.load(block_tables_ptr + r * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            offset = block * stride_cb + kv_head * stride_ch + (k_pos % BLOCK_SIZE) * stride_cs
            keys = tl.load(k_cache_ptr + offset[None, :] + d[:, None],
                           mask=k_ok[None, :] & d_ok[:, None], other=0.0).to(DOT)
            scores = tl.dot(q, keys, input_precision=PRECISION) * scale
            seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            seen = seen & ((window == 0) | (k_pos[None, :] > q_pos[:, None] - window))
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row that has seen no key yet keeps -inf; shift it by 0 instead (exp(-inf) = 0).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.exp(scores - shift[:, None])
            rescale = tl.exp(row_max - shift)
            values = tl.load(v_cache_ptr + offset[:, None] + d[None, :],
                             mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
            row_sum = row_sum * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p.to(DOT), values, input_precision=PRECISION)
            row_max = new_max

        keep = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            if HAS_SINKS:
                row_sum = _with_sinks(row_sum, row_max, sinks_ptr, head, row_ok)
            out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            part = (row * num_heads + head) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=keep)
            tl.store(part_max_ptr + part, row_max, mask=row_ok)
            tl.store(part_sum_ptr + part, row_sum, mask=row_ok)


@triton.jit
def _with_sinks(row_sum, row_max, sinks_ptr, head, ok):
    """A softmax denominator (row_sum, relative to row_max) with each head's sink logit added
    (gpt-oss: a share of the softmax with no value); a row with no key keeps 0."""
    sink = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32)
    return tl.where(row_max == float("-inf"), row_sum, row_sum + tl.exp(sink - row_max))


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One (row, head): the splits' partial softmax sums merged, in split order."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    part = (row * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    maxes = tl.load(part_max_ptr + part)
    top = tl.max(maxes, 0)
    weight = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - top))
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
    acc = tl.sum(tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :]) * weight[:, None], 0)
    if HAS_SINKS:
        total = _with_sinks(total, top, sinks_ptr, head, True)
    # A row with no key (a padding row of a recorded decode step, sequence length 0) gets zeros.
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, window: int, max_query_len: int, max_seq_len: int,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` [T, H, D] over the paged cache; returns [T, H, D] in q's dtype.
    ``sinks`` [H] (gpt-oss): per head a logit in every row's softmax with no value.
    ``max_query_len`` and ``max_seq_len`` are the batch's, known on the host (they size the
    grid without reading the device); bounds above the batch's give the same result (a
    recorded CUDA graph passes fixed ones). A row of sequence length 0 reads no key and gets
    zeros."""
    if k_cache.dtype == torch.int8:
        raise ValueError("the Triton attention reads float KV caches only (kv_cache_dtype auto)")
    tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, row = k_cache.shape
    if row != head_dim or q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous in the head dimension, caches alike")
    group = num_heads // num_kv_heads
    block_m = max(_MIN_ROWS, triton.next_power_of_2(group))
    block_q = block_m // group
    d_pad = max(_MIN_ROWS, triton.next_power_of_2(head_dim))
    num_seqs = seq_lens.shape[0]
    splits = triton.cdiv(max_seq_len, KEYS_PER_SPLIT) if max_query_len == 1 else 1
    num_splits = triton.next_power_of_2(splits)  # the merge kernel's vector width (1: no split)
    out = torch.empty_like(q)
    if splits > 1:  # every (row, head, split) is written, empty splits as max -inf, sum 0
        parts = tokens * num_heads * num_splits
        part_acc = torch.empty(parts * d_pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # not read
    tiles = tokens // block_q + num_seqs
    # Triton's interpreter multiplies 16-bit floats wrongly: it computes in float32 instead.
    dot = tl.float32 if q.dtype == torch.float32 or _interpreting() else _TL_DTYPES[q.dtype]
    _paged_attention_kernel[(tiles, num_kv_heads, num_splits)](
        out, q, k_cache, v_cache, query_start, seq_lens, block_tables,
        part_acc, part_max, part_sum, out if sinks is None else sinks,
        scale, num_seqs, window, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        KEYS_PER_SPLIT // BLOCK_N if splits > 1 else triton.cdiv(max_seq_len, BLOCK_N),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT=dot, PRECISION="ieee" if dot == tl.float32 else "tf32", HAS_SINKS=sinks is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            out, part_acc, part_max, part_sum, out if sinks is None else sinks, num_heads,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None,
        )
    return out


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, slot_ptr, k_ptr, v_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_cs,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # a negative slot is padding: nothing to write
        d = tl.arange(0, D_PAD)
        ok = d < HEAD_DIM
        dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_cs + d
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=ok)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows k, v [T, KVH, D] into the caches at ``slot_mapping`` [T] (block * block_size + offset)."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k_cache.dtype == torch.int8:
        raise ValueError("the Triton KV write stores float KV caches only (kv_cache_dtype auto)")
    _write_kv_kernel[(tokens, num_kv_heads)](
        k_cache, v_cache, slot_mapping, k, v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, D_PAD=max(_MIN_ROWS, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[2],
    )
