"""The paged-attention kernel on prompt chunks: the route the defaults take against the
row-wise kernel of batch-invariant mode, and against torch's SDPA on dense copies.

One layer's attention (16 heads over 8 KV heads, head_dim 64, blocks of 16 shuffled, bf16) for
a step of prompt chunks: several whole prompts of one length, or one later chunk of a long
prompt (its keys before the chunk already cached). The defaults' route (`tiled`) takes chunks
of many rows to ATen's flash attention on AMX CPUs (travelator/kernels/csrc/attention_flash.h)
and to the tiled vector kernel elsewhere; batch-invariant mode takes the row-wise kernel. SDPA
runs on contiguous [prompts, heads, length, 64] copies (whole prompts only). Medians of 7 calls.

    python benchmarks/prefill_attention.py
"""

from __future__ import annotations

import torch

from bench_timing import median_seconds

from travelator import kernels
from travelator.model import kv_layout

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
# (prompts, query rows each, keys each: the rows are the last of those keys)
SHAPES = [(16, 128, 128), (8, 256, 256), (4, 512, 512), (2, 1024, 1024), (1, 2048, 2048), (1, 2048, 4096)]


def report(prompts: int, rows: int, keys: int) -> str:
    blocks_each = -(-keys // BLOCK)
    shape = kv_layout.cache_shape(prompts * blocks_each, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16)
    k_cache, v_cache = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    table = torch.randperm(prompts * blocks_each).view(prompts, blocks_each)
    q = torch.randn(prompts * rows, HEADS, HEAD_DIM).bfloat16()
    query_start = torch.arange(prompts + 1) * rows
    seq_lens = torch.full((prompts,), keys)
    flops = prompts * HEADS * (keys * keys - (keys - rows) ** 2) / 2 * HEAD_DIM * 4  # causal: half the scores

    def attend(tiled: bool) -> torch.Tensor:
        return torch.ops.travelator.paged_attention(q, k_cache, v_cache, query_start, seq_lens, table,
                                                    HEAD_DIM**-0.5, tiled)

    times = {"defaults (tiled)": median_seconds(lambda: attend(True), 7),
             "row-wise (batch-invariant)": median_seconds(lambda: attend(False), 7)}
    if rows == keys:
        qd = q.view(prompts, rows, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        kd, vd = (torch.randn(prompts, KV_HEADS, keys, HEAD_DIM).bfloat16() for _ in range(2))
        times["torch SDPA"] = median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, enable_gqa=True), 7)
    cells = [f"{name} {s * 1e3:.2f} ms ({flops / s / 1e9:.0f} GFLOP/s)" for name, s in times.items()]
    return f"{prompts} x {rows} rows at {keys} keys: " + ", ".join(cells)


def main() -> None:
    kernels.load()
    torch.manual_seed(0)
    for shape in SHAPES:
        print(report(*shape), flush=True)


if __name__ == "__main__":
    main()
