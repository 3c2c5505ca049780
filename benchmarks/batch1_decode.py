"""Batch-1 decode against the time to stream the weights once from memory.

A decode step of one request reads every weight once (the embedding only one row), so
its floor is the time to read those bytes from DRAM. This script measures both on this
machine, in one process: the median engine step of one request decoding (whole steps:
schedule, prepare, forward, sample), and the median time to read a buffer of the same
size with every thread (a float32 sum, which is memory-bound). Target: ratio <= 1.3.

    python benchmarks/batch1_decode.py --model dummy:llama-250m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from travelator import LLM, SamplingParams


def weight_bytes_per_decode(model) -> int:
    """Bytes of every weight a one-token step reads: all of them, the embedding only
    once (as the LM head when tied, else not at all: one row of it is negligible)."""
    embed = model.embed
    total = 0
    for p in model.parameters():
        if p is embed and model.lm_head_weight is not embed:
            continue
        total += p.numel() * p.element_size()
    return total


def stream_seconds(nbytes: int, repeats: int) -> float:
    """Median time to read ``nbytes`` from memory with every thread."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-250m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, kernels=args.kernels,
              enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request([1] + list(range(3, 18)),
                       SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    step = statistics.median(steps)
    nbytes = weight_bytes_per_decode(engine.runner.model)
    stream = stream_seconds(nbytes, repeats=15)
    print(f"{args.model} {args.dtype} kernels={args.kernels}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}: batch-1 decode step {step * 1e3:.1f} ms; "
          f"reading the {nbytes / 1e6:.0f} MB of weights {stream * 1e3:.1f} ms "
          f"({nbytes / stream / 1e9:.1f} GB/s); ratio {step / stream:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
