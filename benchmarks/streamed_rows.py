"""Where a decode step should switch from a streaming kernel to the GEMM library.

The same engine runs decode steps of each row count with the streaming limit set to each
value, alternating, so that the machine's drift falls on all alike; medians of the steps.
bf16 weights: the limit of ``small_m_linear``'s rows (which also decides whether the native
layer stack runs the step), up to the one built. ``--quantized``: the rows up to which
quantized weights take the integer kernel (``NativeOps.quant_kernel_rows``; past it, their
kept bf16 copy or the per-call dequantizing), for a model whose weights are quantized (a
GGUF's blocks, or ``--quantization``). A limit is right where no other is faster at any row
count up to it, and the next row count's GEMM step is not slower than streaming it was.

    python benchmarks/streamed_rows.py --model dummy:llama-50m --limits 2 3 4 --rows 1 2 3 4 5 6
    python benchmarks/streamed_rows.py --quantized --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --limits 8 16 32 --rows 8 12 16 24 32
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
    ap.add_argument("--quantized", action="store_true", help="vary the integer kernel's rows instead")
    ap.add_argument("--quantization", default="auto", help="as LLM's (int8 or int4 to quantize a bf16 model)")
    ap.add_argument("--limits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per limit per round")
    args = ap.parse_args()

    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization, max_num_seqs=max(args.rows),
              enable_prefix_caching=False)
    engine = llm.engine
    ops = engine.runner.ops
    if args.quantized:
        built = ops.quant_kernel_rows

        def set_limit(rows: int) -> None:
            ops.quant_kernel_rows = rows
    else:
        # Lowering the bf16 limit is what a build with a smaller kMaxRows would do; a limit
        # above the built one is refused: the kernel takes no more rows.
        built = ops.streaming_rows(False)
        if not built or max(args.limits) > built:
            raise SystemExit(f"this build streams up to {built} rows; limits must be at most that")

        def set_limit(rows: int) -> None:
            ops._linear._small_m_rows = rows
    rng = random.Random(0)
    vocab = engine.arch.vocab_size
    print(engine.summary)
    print(f"{'quantized' if args.quantized else 'bf16'} streaming limit {built} as started; median ms per decode step")
    print("rows  " + "  ".join(f"limit {lim:>2}" for lim in args.limits))
    for rows in args.rows:
        for _ in range(rows):
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(63)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2_000, ignore_eos=True))
        engine.step()  # the prompts, in one step
        times: dict[int, list[float]] = {lim: [] for lim in args.limits}
        for _ in range(args.rounds):
            for lim in args.limits:
                set_limit(lim)
                engine.step()  # the first step after a switch reads the other route's weights
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    times[lim].append(time.perf_counter() - t0)
        set_limit(built)
        engine.abort_request([r.request_id for r in engine.scheduler.running])
        print(f"{rows:>4}  " + "  ".join(f"{statistics.median(times[lim]) * 1e3:8.2f}" for lim in args.limits),
              flush=True)


if __name__ == "__main__":
    main()
