"""Batch-1 decode against the time to stream the weights once from memory.

A decode step of one request reads every weight once (the embedding only one row), so
its floor is the time to read those bytes from DRAM. This script measures both on this
machine, in one process: the median engine step of one request decoding (whole steps:
schedule, prepare, forward, sample), and the median time to read a buffer of the same
size with every thread (a float32 sum, which is memory-bound). Target: ratio <= 1.3.
With several ``--quantization`` values, each runs in turn in this process (weights kept
int8 / int4: fewer bytes to stream), and the last line gives their speed against the first.

    python benchmarks/batch1_decode.py --model dummy:llama-250m --dtype bfloat16
    python benchmarks/batch1_decode.py --model dummy:llama-250m --quantization none int8 int4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from travelator import LLM, SamplingParams


def weight_bytes_per_decode(model) -> int:
    """Bytes of every weight a one-token step reads (quantized ones as stored): all of them,
    the embedding only once (as the LM head when tied, else not at all: one row of it is
    negligible)."""
    embed = model.embed
    total = model.weight_bytes()
    if model.lm_head_weight is not embed:
        total -= embed.numel() * embed.element_size()
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
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"])
    args = ap.parse_args()
    steps = {q: measure(args, q) for q in args.quantization}
    base = args.quantization[0]
    if len(steps) > 1:
        print("batch-1 decode speed against " + base + ": "
              + ", ".join(f"{q} {steps[base] / t:.2f}x" for q, t in steps.items() if q != base))


def measure(args, quantization: str) -> float:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, kernels=args.kernels,
              enable_prefix_caching=False, quantization=quantization)
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
    print(f"{args.model} {args.dtype} quantization={quantization} kernels={args.kernels}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}: batch-1 decode step "
          f"{step * 1e3:.1f} ms; reading the {nbytes / 1e6:.0f} MB of weights {stream * 1e3:.1f} ms "
          f"({nbytes / stream / 1e9:.1f} GB/s); ratio {step / stream:.2f} (target <= 1.3)", flush=True)
    return step


if __name__ == "__main__":
    main()
