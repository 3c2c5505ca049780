"""Does attention over the paged cache dominate a decode step?

Compares, on the same engine, (a) a step that computes one 64-token prompt with no
context (a bare forward of 64 tokens) with (b) a decode step of 64 requests that
each have about 256 tokens of context. Target: (b) costs at most 1.5x (a).
Medians of repeated steps; whole engine steps (schedule, prepare, forward, sample,
update), so engine overhead is included in both.

(a) computes the logits of its prompt's last token only, as every prefill does; (b)
computes 64 rows of logits. So a third step, (c) 64 one-token prompts in one step, is
also timed: the same 64 rows of logits, samples and outputs as (b), and nothing to
attend to but each token itself. (b) / (c) is then the cost of the context alone.

    python benchmarks/decode_step.py --model dummy:llama-250m --dtype bfloat16
    python benchmarks/decode_step.py --model dummy:llama-50m --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from travelator import LLM, SamplingParams


def timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-250m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or int8, ...")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, kernels=args.kernels,
              batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=max(1024, args.batch), enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.arch.vocab_size

    def prompt(n: int) -> list[int]:
        return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]

    # (a) one prompt of `batch` tokens, no context: each step is a fresh request.
    bare = []
    for _ in range(args.repeats):
        engine.add_request(prompt(args.batch), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        bare.append(timed_step(engine))
    # (b) `batch` requests with `context` tokens each, then decode steps.
    # Long enough outputs that the first requests still decode when the last prefill ends.
    steps_to_prefill = -(-args.batch * args.context // engine.config.scheduler.max_num_batched_tokens)
    ids = [engine.add_request(prompt(args.context),
                              SamplingParams(temperature=0, max_tokens=steps_to_prefill + 2 * args.repeats,
                                             ignore_eos=True)).request_id
           for _ in range(args.batch)]
    while engine.last_step.num_decodes != args.batch:
        engine.step()
    decode = [timed_step(engine) for _ in range(args.repeats)]
    engine.abort_request(ids)
    # (c) `batch` one-token prompts in one step (after (b): a one-token prompt counts as a
    # decode in the step's statistics, which (b) waits on).
    singles = []
    for _ in range(args.repeats):
        for _ in range(args.batch):
            engine.add_request([rng.randrange(3, vocab)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        singles.append(timed_step(engine))

    a, b, c = statistics.median(bare), statistics.median(decode), statistics.median(singles)
    print(f"{args.model} {args.dtype} kernels={args.kernels} batch_invariant={args.batch_invariant} "
          f"kv_cache_dtype={args.kv_cache_dtype}: bare forward of {args.batch} tokens {a * 1e3:.1f} ms; "
          f"decode step of {args.batch} requests x ~{args.context} context {b * 1e3:.1f} ms; "
          f"ratio {b / a:.2f} (target <= 1.5); {args.batch} one-token prompts {c * 1e3:.1f} ms, "
          f"decode step / that {b / c:.2f}")


if __name__ == "__main__":
    main()
