"""Attention over the paged KV cache: the only per-request operation of a step.

The flat batch is ordered decodes first (one query each), then prefill chunks.
Decodes are handled all at once: their blocks are gathered into a padded
[B, L] key range with a length mask, one SDPA call for the lot. Each prefill
chunk gets its own SDPA call with a bottom-right causal mask: query i of a chunk
that starts at position p sees keys 0..p+i (docs/design.md invariant 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first query in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks] long, covers context_len + query_len


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # Write before reading (docs/design.md invariant 4): a chunk's own keys come from the
        # cache too.
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            out[s : s + n] = self._prefill(q[s : s + n], k[s : s + n], v[s : s + n],
                                           k_cache, v_cache, chunk)
        return out

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Blocks of one or more requests as a [..., KVH, L, D] key range."""
        # index_select on the flat block list is ~2x faster than advanced indexing on CPU.
        _, bs, kvh, d = cache.shape
        g = cache.index_select(0, block_table.reshape(-1))  # [N * nb, bs, KVH, D]
        g = g.view(*block_table.shape[:-1], block_table.shape[-1] * bs, kvh, d)
        return g.transpose(-3, -2)  # [..., KVH, L, D]

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        keys = self._gather(k_cache, meta.decode_block_tables).to(q.dtype)  # [B, KVH, L, D]
        values = self._gather(v_cache, meta.decode_block_tables).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
            scale=self.scale, enable_gqa=True,
        )  # [B, H, 1, D]
        return o.squeeze(2)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        qh = q.transpose(0, 1)  # [H, n, D]
        if chunk.context_len == 0:
            # No cached prefix: keys are exactly this chunk, top-left causal is right.
            # Round them as the cache stores them, so a chunk sees the same keys whether
            # it reads them fresh or from the cache (a KV dtype below the model's).
            if k_cache.dtype != k.dtype:
                k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qh, k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
            return o.transpose(0, 1)
        total = chunk.context_len + chunk.query_len
        keys = self._gather(k_cache, chunk.block_table)[:, :total].to(q.dtype)
        values = self._gather(v_cache, chunk.block_table)[:, :total].to(q.dtype)
        q_pos = torch.arange(chunk.context_len, total, device=q.device).unsqueeze(1)
        k_pos = torch.arange(total, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos  # bottom-right aligned causal mask
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return o.transpose(0, 1)
