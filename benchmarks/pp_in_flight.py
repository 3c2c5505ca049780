"""Pipeline parallelism with one step at a time against one step in flight per stage.

A W-like workload: 32 requests, prompts U[16,256], outputs U[8,128] forced to their length,
all present at the start, greedy. One engine, ``--pipeline-parallel-size 2`` (one torch thread
per rank), runs it alternately with ``set_steps_in_flight(1)`` and ``(2)``, ``--repeats``
times each, so both see the same processes and the same machine; output tokens per second,
with the load average before each run.

    python benchmarks/pp_in_flight.py --model dummy:llama-50m --repeats 2
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from travelator import LLM, SamplingParams
from travelator.model.device import cpu_model_name


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 30000) for _ in range(rng.randint(16, 256) - 1)], rng.randint(8, 128))
            for _ in range(n)]


def timed_run(llm: LLM, work: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    t0 = time.perf_counter()
    results = llm.generate([p for p, _ in work], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == [m for _, m in work]
    return sum(m for _, m in work) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TRAVELATOR_TP_THREADS", "1")
    torch.set_num_threads(1)
    work = workload(args.requests, seed=0)
    llm = LLM(args.model, device="cpu", pipeline_parallel_size=2, max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=1024)
    try:
        llm.generate([work[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        print(f"{cpu_model_name()}; {args.model}, {args.requests} requests, "
              f"{sum(m for _, m in work)} output tokens")
        for _ in range(args.repeats):
            for steps in (1, 2):
                llm.engine.set_steps_in_flight(steps)
                load = os.getloadavg()[0]
                print(f"steps in flight {steps}: {timed_run(llm, work):.1f} output tok/s (load {load:.1f})",
                      flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
