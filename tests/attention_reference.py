"""The float64 reference of paged attention and the random batches every attention kernel's
tests use (the native CPU kernel, the int8 cache, the Triton kernel)."""

from __future__ import annotations

import torch

from travelator.model.attention import PagedAttention, build_metadata


def make_cache(num_blocks, block_size, kvh, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kvh, d)
    # As the cache lays them out (model/kv_layout.py): [blocks, kv heads, block_size, row].
    return (torch.randn(shape, generator=g).to(dtype).transpose(1, 2).contiguous() for _ in range(2))


def reference(q, k_cache, v_cache, requests, scale, window=None, sinks=None):
    """Dense float64 attention per request: query at position p sees keys 0..p, or with a
    sliding window only the keys k with p - window < k <= p (transformers' convention); with
    sinks ([H], gpt-oss), each head's row softmax has one more logit, the sink, whose weight is
    dropped (as transformers' eager gpt-oss attention computes it)."""
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out, row = [], 0
    for context, n, table in requests:
        total = context + n
        # Position p's rows: block table[p // bs], every head, place p % bs in the block.
        blocks = torch.tensor([table[p // bs] for p in range(total)], dtype=torch.long)
        keys, vals = (cache[blocks, :, torch.arange(total) % bs] for cache in (k_cache, v_cache))
        keys, vals = (x.double().repeat_interleave(group, 1) for x in (keys, vals))
        qr = q[row : row + n].double()
        scores = torch.einsum("nhd,khd->hnk", qr, keys) * scale
        pos = torch.arange(context, total).unsqueeze(1)
        keys_pos = torch.arange(total).unsqueeze(0)
        hidden = keys_pos > pos
        if window is not None:
            hidden |= keys_pos <= pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out.append(torch.einsum("hnk,khd->nhd", probs, vals))
        row += n
    return torch.cat(out)


def metadata(requests, backend, block_size):
    """requests: (context_len, query_len, block_table) in flat order, decodes first."""
    return build_metadata(backend, torch.empty(0, dtype=torch.long), [n for _, n, _ in requests],
                          [c for c, _, _ in requests], [t for _, _, t in requests], block_size,
                          torch.device("cpu"))


def random_requests(rng, num_blocks, block_size, n_decodes, n_prefills):
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    reqs = []
    for i in range(n_decodes + n_prefills):
        n = 1 if i < n_decodes else rng.randint(2, 40)
        context = rng.randint(0 if i >= n_decodes else 1, 70)
        need = -(-(context + n) // block_size)
        table, blocks = blocks[:need], blocks[need:]
        reqs.append((context, n, table))
    return reqs


def attend(backend, q, k_cache, v_cache, reqs, heads, kvh, d, tiled=False, window=None, sinks=None,
           amx_tiles=True):
    """amx_tiles=False: the native kernel's routes as on a CPU without AMX's tiles."""
    attn = PagedAttention(heads, kvh, d, window=window)
    meta = metadata(reqs, backend, k_cache.shape[2])
    meta.tiled_prefill = tiled
    if not amx_tiles:
        return torch.ops.travelator.paged_attention(q, k_cache, v_cache, meta.query_start, meta.seq_lens,
                                                    meta.block_tables, attn.scale, tiled, window or 0, sinks, False)
    # The cache already holds every key: only read it (an empty write).
    k_new = torch.empty(0, kvh, d, dtype=q.dtype)
    return attn(q, k_new, k_new, k_cache, v_cache, meta, sinks)
