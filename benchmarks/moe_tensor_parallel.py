"""A mixture of experts on two tensor-parallel ranks: every expert's intermediate size split over
the ranks (the default) against whole experts placed on them (``expert_parallel``), with one
rank beside them, in one process, one after another.

Two figures per setting: batch-1 decode (one request, 128-token prompt; the decode rate from the
difference between 129 and 1 output tokens, so the prompt's time drops out) and a batch of 16
requests (128 in, 64 out each: output tokens per second over the whole run).

    python benchmarks/moe_tensor_parallel.py --model dummy:qwen3-moe-1b
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from travelator import LLM, SamplingParams

SETTINGS = {
    "1 rank": dict(tensor_parallel_size=1),
    "2 ranks, experts split": dict(tensor_parallel_size=2),
    "2 ranks, experts placed": dict(tensor_parallel_size=2, expert_parallel=True),
}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed(llm: LLM, batch: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t0


def measure(llm: LLM, repeats: int) -> tuple[float, float]:
    """(batch-1 decode tok/s, batch-16 output tok/s), medians over ``repeats``."""
    vocab = llm.engine.arch.vocab_size
    one = prompts(1, 128, vocab, 0)
    many = prompts(16, 128, vocab, 1)
    timed(llm, one, 8)  # warm-up
    decode, batch = [], []
    for r in range(repeats):
        one = prompts(1, 128, vocab, 10 + r)  # no prefix-cache hit between runs
        decode.append(128 / (timed(llm, one, 129) - timed(llm, prompts(1, 128, vocab, 100 + r), 1)))
        many = prompts(16, 128, vocab, 200 + r)
        batch.append(16 * 64 / timed(llm, many, 64))
    return statistics.median(decode), statistics.median(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen3-moe-1b")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"model {args.model}, {os.cpu_count()} CPUs (each of 2 ranks: 1 torch thread)")
    print(f"{'setting':<26} {'batch-1 decode tok/s':>21} {'16 requests out tok/s':>22}")
    for name, setting in SETTINGS.items():
        llm = LLM(args.model, max_num_seqs=16, max_num_batched_tokens=2048, **setting)
        try:
            decode, batch = measure(llm, args.repeats)
        finally:
            llm.shutdown()
        print(f"{name:<26} {decode:>21.1f} {batch:>22.1f}", flush=True)


if __name__ == "__main__":
    main()
