"""The paged-attention kernel alone, on decodes: is it held by memory or by arithmetic?

64 decodes x 257 keys (8 heads over 4 KV heads, head_dim 64, blocks of 16, bf16), over the
caches of 8 layers in turn (8.4 MB a layer, more than the L3 holds), with each request's
blocks in order or shuffled; then every request on the same 17 blocks (in L2: the
arithmetic alone); and a sum over the same caches (the memory alone). Medians of 15
calls, per layer.

    python benchmarks/attention_kernel.py
"""

from __future__ import annotations

import random

import torch

from bench_timing import median_seconds

from travelator import kernels
from travelator.model import kv_layout

REQUESTS, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 64, 256, 8, 4, 64, 16, 8


def per_layer_us(fn) -> float:
    return median_seconds(fn, 15) / LAYERS * 1e6


def main() -> None:
    kernels.load()
    attention = torch.ops.travelator.paged_attention
    blocks_per_request = CONTEXT // BLOCK + 1
    num_blocks = REQUESTS * blocks_per_request
    shape = kv_layout.cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16)
    torch.manual_seed(0)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    tables = {
        "blocks in order": torch.arange(num_blocks).view(REQUESTS, blocks_per_request),
        "blocks shuffled": torch.tensor(order).view(REQUESTS, blocks_per_request),
    }
    q = torch.randn(REQUESTS, HEADS, HEAD_DIM).bfloat16()
    query_start = torch.arange(REQUESTS + 1)
    seq_lens = torch.full((REQUESTS,), CONTEXT + 1)
    results = {name: per_layer_us(lambda t=t: [attention(q, k, v, query_start, seq_lens, t, HEAD_DIM**-0.5, False)
                                               for k, v in caches])
               for name, t in tables.items()}
    same = torch.arange(blocks_per_request).repeat(REQUESTS, 1)
    k0, v0 = caches[0]
    results["in L2"] = per_layer_us(lambda: [attention(q, k0, v0, query_start, seq_lens, same, HEAD_DIM**-0.5, False)
                                             for _ in range(LAYERS)])
    results["a sum over the caches"] = per_layer_us(lambda: [(k.sum(), v.sum()) for k, v in caches])
    print("  ".join(f"{name}: {us:.0f} us" for name, us in results.items()))


if __name__ == "__main__":
    main()
