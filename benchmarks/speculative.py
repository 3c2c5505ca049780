"""Speculative decoding (n-gram prompt lookup) on a copy-heavy workload: off, a fixed number
of drafts, and the adaptive policy, at several batch sizes.

Each request's prompt is a story the model wrote itself (greedy, from its own opening words),
given twice and then its opening again, as token ids, so the model continues text it has seen:
outputs repeat spans of the prompt. Greedy, ``--max-tokens`` each, every request present at t=0. Per
batch size the three settings run in turn, ``--repeats`` times; the figures are medians:
output tokens per second over the whole batch, and the median time per output token (TPOT)
of its requests.

    python benchmarks/speculative.py --model ../shared/models/stories260K.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from travelator import LLM, SamplingParams
from travelator.model.device import cpu_model_name

OPENINGS = ["Once upon a time", "Tom and his dog", "Lily saw a big", "The sun was", "One day, a little",
            "Sam had a red", "The cat and the", "Mia went to the"]
SETTINGS = {"off": {}, "fixed k=4": dict(speculative_method="ngram", speculative_policy="fixed"),
            "adaptive": dict(speculative_method="ngram", speculative_policy="adaptive")}


def copy_prompts(model: str, dtype: str, n: int) -> list[list[int]]:
    """Token ids (the story's own, not a re-encoding of its text, which may split words
    differently): opening, story, opening, story, opening."""
    writer = LLM(model, dtype=dtype)
    stories = writer.generate(OPENINGS, SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False)
    prompts = []
    for opening, story in zip(OPENINGS, stories):
        start = writer.engine.tokenizer.encode(opening)  # with BOS
        ids = story.outputs[0].token_ids
        prompts.append(start + ids + start[1:] + ids + start[1:])
    return [prompts[i % len(prompts)] for i in range(n)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float]:
    """(output tokens per second, median TPOT in ms, mean tokens per request-step)."""
    steps_before = llm.engine.counters.speculative_steps, llm.engine.counters.accepted_draft_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(c.timings.total - c.timings.first_token) / (len(c.token_ids) - 1)
             for c in (o.outputs[0] for o in outs)]
    c = llm.engine.counters
    spec_steps = c.speculative_steps - steps_before[0]
    accepted = c.accepted_draft_tokens - steps_before[1]
    return tokens / wall, statistics.median(tpots) * 1e3, (accepted / spec_steps if spec_steps else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="../shared/models/stories260K.gguf")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engines = {name: LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batches), **kw)
               for name, kw in SETTINGS.items()}
    print(f"{cpu_model_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {args.model} "
          f"{args.dtype}, greedy, {args.max_tokens} tokens a request, medians of {args.repeats}")
    print(f"{'batch':>5}  {'setting':<10} {'tok/s':>8} {'TPOT ms':>8} {'x off':>6}  accepted per drafted step")
    for batch in args.batches:
        prompts = copy_prompts(args.model, args.dtype, batch)
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                results[name].append(run(llm, prompts, args.max_tokens))
        off = statistics.median(r[0] for r in results["off"])
        for name, rs in results.items():
            tps = statistics.median(r[0] for r in rs)
            print(f"{batch:>5}  {name:<10} {tps:>8.0f} {statistics.median(r[1] for r in rs):>8.2f} "
                  f"{tps / off:>6.2f}  {statistics.median(r[2] for r in rs):.2f}")


if __name__ == "__main__":
    main()
