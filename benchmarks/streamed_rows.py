"""Where a decode step should switch from streaming the bf16 weights to the GEMM library.

The same engine runs decode steps of each row count with the bf16 streaming limit
(``small_m_linear``'s rows, which also decides whether the native layer stack runs the step)
set to each value up to the one built, alternating, so that the machine's drift falls on all
alike; medians of the steps. The built limit is right where no lower one is faster at any
row count up to it, and the next row count's GEMM step is not slower than streaming it was.

    python benchmarks/streamed_rows.py --model dummy:llama-50m --limits 2 4 --rows 1 2 3 4 5 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from travelator import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--limits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per limit per round")
    args = ap.parse_args()

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(args.rows), enable_prefix_caching=False)
    engine = llm.engine
    # The limit lives on the runner's linear layers; lowering it is what a build with a smaller
    # kMaxRows would do. A limit above the built one is refused: the kernel takes no more rows.
    linear = engine.runner.ops._linear
    built = linear.streaming_rows(False)
    if not built or max(args.limits) > built:
        raise SystemExit(f"this build streams up to {built} rows; limits must be at most that")
    rng = random.Random(0)
    vocab = engine.arch.vocab_size
    print(f"model {args.model}, bf16, streaming built for up to {built} rows; median ms per decode step")
    print("rows  " + "  ".join(f"limit {lim:>2}" for lim in args.limits))
    for rows in args.rows:
        for _ in range(rows):
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(63)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2_000, ignore_eos=True))
        engine.step()  # the prompts, in one step
        times: dict[int, list[float]] = {lim: [] for lim in args.limits}
        for _ in range(args.rounds):
            for lim in args.limits:
                linear._small_m_rows = lim
                engine.step()  # the first step after a switch reads the other route's weights
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    times[lim].append(time.perf_counter() - t0)
        linear._small_m_rows = built
        engine.abort_request([r.request_id for r in engine.scheduler.running])
        print(f"{rows:>4}  " + "  ".join(f"{statistics.median(times[lim]) * 1e3:8.2f}" for lim in args.limits),
              flush=True)


if __name__ == "__main__":
    main()
