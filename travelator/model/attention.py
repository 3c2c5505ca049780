"""Attention over the paged KV cache: the only per-request operation of a step.

Three backends read the same metadata:

- ``native`` (default where it builds): one C++ call per layer for the whole flat
  batch, decodes and prefill chunks of any length mixed, keys and values read in place
  through the block tables (travelator/kernels/csrc/paged_attention.cpp). Each query row
  is reduced over its keys in chunks of a fixed number of absolute positions, with the same
  code whatever else is in the step, so a request's numbers do not depend on its batch. Outside batch-invariant
  mode, bf16 prefill tiles take a tiled kernel instead (query rows in vector lanes,
  faster on long prompts), whose numbers depend on how the prompt was chunked.
- ``triton``: the same one call per layer on a CUDA device, in Triton
  (travelator/kernels/triton_attention.py), with its own KV write; float KV caches only.
- ``torch``: the fallback for machines without a compiler. The flat batch is ordered
  decodes first; their blocks are gathered into a padded [B, L] key range with a length
  mask, one SDPA call for the lot. Each prefill chunk gets its own SDPA call with a
  bottom-right causal mask: query i of a chunk that starts at position p sees keys
  0..p+i (docs/design.md invariant 3).

A layer with a sliding window (Mistral, Gemma 3's local layers) narrows that on both
paths as transformers does: a query at position p sees keys p - window + 1 .. p (key k
is seen when k > p - window). No path reads the blocks wholly before the first key
a request's queries see.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from travelator.model import kv_layout

AttentionBackend = Literal["native", "triton", "torch"]


@dataclass(slots=True)
class AttentionMetadata:
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    query_start: torch.Tensor  # [B + 1] long: request r's queries are rows qs[r]..qs[r+1]
    seq_lens: torch.Tensor  # [B] long: tokens in the cache once this step's are written
    block_tables: torch.Tensor  # [B, width] long, padded with block 0
    num_decodes: int  # the first num_decodes requests have one query each
    query_lens: list[int]  # host copies, for the torch path
    context_lens: list[int]  # tokens cached before this step, per request
    max_query_len: int = 0  # the batch's longest query and sequence: the triton path's grid
    max_seq_len: int = 0
    decode_mask: torch.Tensor | None = None  # torch path: [nd, 1, 1, width * block_size] bool
    # torch path: the decodes' blocks and mask under each sliding window met (window_decode)
    window_decodes: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # native path: prefill tiles may take the faster tiled kernel, whose numbers depend on
    # the tile (off in batch-invariant mode)
    tiled_prefill: bool = False

    def window_decode(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path's decodes in a layer with a sliding window: per decode, the blocks
        from the one that holds the first key it sees ([nd, n] block ids, n = the most blocks
        a window spans), and which of their positions it sees ([nd, 1, 1, n * block_size]
        bool): a decode at position seq_len - 1 sees keys k > seq_len - 1 - window, i.e.
        seq_len - window <= k < seq_len. Built once per window and step."""
        got = self.window_decodes.get(window)
        if got is None:
            lens = self.seq_lens[: self.num_decodes, None]
            width = self.decode_mask.shape[-1] // block_size  # the decodes' widest table
            first = (lens - window).clamp(min=0) // block_size
            n = min(width, -(-window // block_size) + 1)
            # Columns past a decode's table repeat its last one (positions it does not see).
            cols = (first + torch.arange(n, device=lens.device)).clamp(max=width - 1)
            k_pos = first * block_size + torch.arange(n * block_size, device=lens.device)
            mask = (k_pos < lens) & (k_pos >= lens - window)
            got = self.window_decodes[window] = (self.block_tables[: self.num_decodes].gather(1, cols),
                                                 mask[:, None, None, :])
        return got


def slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions start .. end - 1 of a request whose blocks are
    ``block_ids``: position p goes to slot block_ids[p // block_size] * block_size + p % block_size.
    A range per block touched, not a number per position."""
    slots: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        shift = (block_ids[b] - b) * block_size
        slots.extend(range(shift + max(start, b * block_size), shift + min(end, (b + 1) * block_size)))
    return slots


def build_metadata(backend: AttentionBackend, slot_mapping: torch.Tensor, query_lens: list[int],
                   context_lens: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device, tiled_prefill: bool = False) -> AttentionMetadata:
    """The metadata of one flat batch, requests in batch order with decodes first; each
    block table covers at least its request's context plus query. Built from lists with
    one tensor call each: a batch-1 step's host work is mostly per-call costs."""
    width = max(len(t) for t in block_tables)
    table = [t + [0] * (width - len(t)) for t in block_tables]
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    decode_mask = None
    if backend == "torch" and num_decodes:
        decode_width = max(len(t) for t in block_tables[:num_decodes])
        lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.long, device=device)
        decode_mask = torch.arange(decode_width * block_size, device=device).unsqueeze(0) < lens.unsqueeze(1)
        decode_mask = decode_mask[:, None, None, :]
    return AttentionMetadata(
        backend=backend,
        slot_mapping=slot_mapping,
        query_start=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=torch.tensor(table, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        query_lens=query_lens,
        context_lens=context_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_mask=decode_mask,
        tiled_prefill=tiled_prefill,
    )


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None,
                 scale: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window  # a query at position p sees keys p - window + 1 .. p (None: 0 .. p)
        self.scale = head_dim**-0.5 if scale is None else scale  # Gemma 3: query_pre_attn_scalar ** -0.5

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, row]: row D, or D + 4 (int8, model/kv_layout.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [H] (gpt-oss): a logit per head with no value
    ) -> torch.Tensor:
        # Write before reading (docs/design.md invariant 4): a chunk's own keys come from the
        # cache too.
        if meta.backend == "triton":
            return self._triton_attention(q, k, v, k_cache, v_cache, meta, sinks)
        if meta.backend == "native" and k_cache.dtype in (k.dtype, torch.int8):
            torch.ops.travelator.write_kv_(k_cache, v_cache, meta.slot_mapping, k, v)
        else:
            kv_layout.write_rows(k_cache, meta.slot_mapping, _as_stored(k, k_cache.dtype))
            kv_layout.write_rows(v_cache, meta.slot_mapping, _as_stored(v, v_cache.dtype))
        if meta.backend == "native":
            return torch.ops.travelator.paged_attention(
                q, k_cache, v_cache, meta.query_start, meta.seq_lens,
                meta.block_tables, self.scale, meta.tiled_prefill, self.window or 0, sinks,
            )
        return _TorchAttention(self, sinks)(q, k, v, k_cache, v_cache, meta)

    def _triton_attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, sinks) -> torch.Tensor:
        from travelator.kernels import triton_attention  # imports triton: only on this path

        triton_attention.write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
            self.window or 0, meta.max_query_len, meta.max_seq_len, sinks)


class _TorchAttention:
    """The pure-torch fallback: one layer's attention of one step, on SDPA. Sinks join each
    row's softmax as one more key whose score is the sink and whose value is zero (an additive
    mask column over a zero key)."""

    def __init__(self, layer: PagedAttention, sinks: torch.Tensor | None) -> None:
        self.window, self.scale, self.sinks = layer.window, layer.scale, sinks

    def _sdpa(self, q, keys, values, mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [..., H, n, D] against keys and values [..., KVH, L, D]; mask: which keys each query
        sees (broadcast to [..., H, n, L]; None: causal, the last query seeing every key)."""
        if self.sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=True)
        n, length = q.shape[-2], keys.shape[-2]
        if mask is None:
            mask = _mask(torch.arange(length - n, length, device=q.device), torch.arange(length, device=q.device), None)
        shape = q.shape[:-1] + (length,)
        bias = torch.zeros(shape, dtype=q.dtype, device=q.device).masked_fill(~mask.expand(shape), float("-inf"))
        sink = self.sinks.to(q.dtype).view(-1, 1, 1).expand(q.shape[:-1] + (1,))
        zero = keys.new_zeros(keys.shape[:-2] + (1, keys.shape[-1]))
        return F.scaled_dot_product_attention(
            q, torch.cat([keys, zero], dim=-2), torch.cat([values, zero], dim=-2),
            attn_mask=torch.cat([bias, sink], dim=-1), scale=self.scale, enable_gqa=True)

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        s = nd
        for r in range(nd, len(meta.query_lens)):
            n = meta.query_lens[r]
            out[s : s + n] = self._prefill(q[s : s + n], k[s : s + n], v[s : s + n],
                                           k_cache, v_cache, meta.context_lens[r],
                                           meta.block_tables[r])
            s += n
        return out

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks of one or more requests as a [..., KVH, L, D] key range of ``dtype``."""
        g = kv_layout.gather_positions(cache, block_table)
        return kv_layout.dequantize_rows(g, dtype) if cache.dtype == torch.int8 else g.to(dtype)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        block_size = k_cache.shape[2]
        tables = meta.block_tables[: meta.num_decodes, : meta.decode_mask.shape[-1] // block_size]
        mask = meta.decode_mask
        if self.window:  # only the blocks of each decode's window
            tables, mask = meta.window_decode(self.window, block_size)
        keys = self._gather(k_cache, tables, q.dtype)  # [B, KVH, L, D]
        values = self._gather(v_cache, tables, q.dtype)
        return self._sdpa(q.unsqueeze(2), keys, values, mask).squeeze(2)  # [B, H, 1, D] -> [B, H, D]

    def _prefill(self, q, k, v, k_cache, v_cache, context_len: int,
                 block_table: torch.Tensor) -> torch.Tensor:
        qh = q.transpose(0, 1)  # [H, n, D]
        n, window = q.shape[0], self.window
        if context_len == 0:
            # No cached prefix: keys are exactly this chunk, top-left causal is right.
            # Round them as the cache stores them, so a chunk sees the same keys whether
            # it reads them fresh or from the cache (a KV dtype below the model's).
            if k_cache.dtype != k.dtype:
                k, v = _as_read(k, k_cache.dtype, q.dtype), _as_read(v, v_cache.dtype, q.dtype)
            pos = torch.arange(n, device=q.device)
            # Without a window reaching short of key 0, plain causal.
            mask = None if not window or window >= n else _mask(pos, pos, window)
            return self._sdpa(qh, k.transpose(0, 1), v.transpose(0, 1), mask).transpose(0, 1)
        total = context_len + n
        # Keys from the block holding the first one the chunk's first query sees.
        start = (max(0, context_len + 1 - window) if window else 0) // k_cache.shape[2] * k_cache.shape[2]
        table = block_table[start // k_cache.shape[2]:]
        keys = self._gather(k_cache, table, q.dtype)[:, : total - start]
        values = self._gather(v_cache, table, q.dtype)[:, : total - start]
        q_pos = torch.arange(context_len, total, device=q.device)
        k_pos = torch.arange(start, total, device=q.device)
        return self._sdpa(qh, keys, values, _mask(q_pos, k_pos, window)).transpose(0, 1)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] bool: which keys each query sees, by position (bottom-right aligned
    causal; with a window, only keys k > q - window)."""
    q_pos, k_pos = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [T, KVH, D] as the cache stores them."""
    return kv_layout.quantize_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def _as_read(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Rows as they read back from a cache of ``cache_dtype``, in ``dtype``."""
    if cache_dtype == torch.int8:
        return kv_layout.dequantize_rows(kv_layout.quantize_rows(x), dtype)
    return x.to(cache_dtype).to(dtype)
