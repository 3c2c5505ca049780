"""The paged-attention kernel alone, on decodes: is it held by memory or by arithmetic?

64 decodes x 257 keys (8 heads over 4 KV heads, head_dim 64, blocks of 16, bf16: W 50M's
attention), over the caches of 8 layers in turn (8.4 MB a layer, more than the L3 holds), with
each request's blocks in order or shuffled; then every request on the same 17 blocks (in L2:
the arithmetic alone); then one decode at 512 and at 2,048 keys (16 heads over 8 KV heads: the
250M Llama's batch-1 step, 16 layers in turn); and a sum over the 64-decode caches (the memory
alone). Per layer: medians of 3 rounds of 5 calls. With `--against REV` the same cases on another git
revision's kernel too (built beside this one's, as benchmarks/prefill_attention.py does), the
two taking turns round by round.

    python benchmarks/attention_kernel.py
    python benchmarks/attention_kernel.py --against dce4fd1   # before the AVX2 kernel's rework
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench_timing import median_seconds
from prefill_attention import kernel_at

from travelator import kernels
from travelator.model import kv_layout

HEAD_DIM, BLOCK = 64, 16


@dataclass
class DecodeCase:
    """Decodes over `layers` layers' caches, one call a layer ("in L2": every layer and request
    on the same blocks of one cache)."""
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    table: torch.Tensor
    q: torch.Tensor
    seq_lens: torch.Tensor
    layers: int

    def run(self, attention: Callable[..., torch.Tensor]) -> None:
        query_start = torch.arange(len(self.seq_lens) + 1)
        for layer in range(self.layers):
            k, v = self.caches[layer % len(self.caches)]
            attention(self.q, k, v, query_start, self.seq_lens, self.table, HEAD_DIM**-0.5, False)


def decode_case(requests: int, context: int, heads: int, kv_heads: int, layers: int,
                order: str = "in order") -> DecodeCase:
    blocks_per_request = context // BLOCK + 1
    num_blocks = blocks_per_request if order == "in L2" else requests * blocks_per_request
    shape = kv_layout.cache_shape(num_blocks, BLOCK, kv_heads, HEAD_DIM, torch.bfloat16)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
              for _ in range(1 if order == "in L2" else layers)]
    blocks = list(range(num_blocks))
    if order == "shuffled":
        random.Random(0).shuffle(blocks)
    table = (torch.tensor(blocks).repeat(requests, 1) if order == "in L2"
             else torch.tensor(blocks).view(requests, blocks_per_request))
    return DecodeCase(caches, table, torch.randn(requests, heads, HEAD_DIM).bfloat16(),
                      torch.full((requests,), context + 1), layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="also time the kernel of this git revision")
    args = parser.parse_args()
    kernels.load()
    attentions = {"this tree": torch.ops.travelator.paged_attention}
    if args.against:
        attentions[f"at {args.against}"] = kernel_at(args.against)
    torch.manual_seed(0)
    cases = {f"64 decodes x 257 keys, blocks {order}": decode_case(64, 256, 8, 4, 8, order)
             for order in ("in order", "shuffled", "in L2")}
    cases |= {f"1 decode x {n} keys": decode_case(1, n - 1, 16, 8, 16) for n in (512, 2048)}
    for name, case in cases.items():
        rounds: dict[str, list[float]] = {who: [] for who in attentions}
        for _ in range(3):  # the kernels in turn, so that a slow minute of the machine slows both
            for who, a in attentions.items():
                rounds[who].append(median_seconds(lambda a=a: case.run(a), 5) / case.layers * 1e6)
        times = {who: statistics.median(us) for who, us in rounds.items()}
        ratio = f" (this tree / the other {times['this tree'] / times[f'at {args.against}']:.2f})" if args.against else ""
        print(f"{name}: " + ", ".join(f"{who} {us:.0f} us" for who, us in times.items()) + ratio, flush=True)
    caches = cases["64 decodes x 257 keys, blocks in order"].caches
    read = median_seconds(lambda: [(k.sum(), v.sum()) for k, v in caches], 15) / len(caches) * 1e6
    print(f"a sum over the 64-decode caches: {read:.0f} us a layer")


if __name__ == "__main__":
    main()
