"""What a grammar costs a decode step: 32 requests under a JSON schema against 32 free ones.

One engine per batch (free, and one per schema), same settings and shape; the engines take
steps in turn, so a slow spell of the machine hits every batch alike, and the figure is the
median over steps of each constrained step against the free step next to it. A constrained
batch pays for filling one token mask per row (in the background, during the forward pass)
and applying it before sampling. Also the time to compile and check a schema and to build a
matcher (llguidance).

    python benchmarks/structured_step.py --model dummy:llama-50m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import llguidance

from travelator import LLM, SamplingParams
from travelator.structured import StructuredOutput

# Two schemas of one shape. Bounded strings cost more: every character moves the grammar's
# lexer to a new state (a count), so llguidance cannot reuse the mask of an earlier state.
SCHEMAS = {
    "free strings": {"type": "object", "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"], "additionalProperties": False},
    "bounded strings": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 400},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 50}},
        "required": ["name", "tags"], "additionalProperties": False},
}


def start_decoding(llm: LLM, structured: StructuredOutput | None, batch: int, steps: int) -> None:
    """Add ``batch`` requests and step until all of them decode."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request([1] + [3 + (i * 7 + k) % 200 for k in range(31)],
                           SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True,
                                          structured=structured))
    while engine.last_step is None or engine.last_step.num_decodes != batch:
        engine.step()


def timed_step_ms(llm: LLM) -> float:
    t0 = time.perf_counter()
    llm.engine.step()
    return (time.perf_counter() - t0) * 1e3


def mean_ms(call, repeats: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    configs: dict[str, StructuredOutput | None] = {"free": None}
    configs.update({name: StructuredOutput(json=schema) for name, schema in SCHEMAS.items()})
    engines = {name: LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, enable_prefix_caching=False)
               for name in configs}
    for name, structured in configs.items():
        start_decoding(engines[name], structured, args.batch, args.steps)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.steps):
        for name in configs:
            times[name].append(timed_step_ms(engines[name]))
    free = times["free"]
    print(f"{args.model} {args.dtype}, {args.batch} requests, {args.steps} steps taken in turn, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  free: decode step median {statistics.median(free):.1f} ms")
    tk = engines["free"].engine.tokenizer
    lt = llguidance.LLTokenizer(tk.backend.to_str(), n_vocab=engines["free"].engine.arch.vocab_size,
                                eos_token=sorted(tk.eos_token_ids))
    for name, schema in SCHEMAS.items():
        ratio = statistics.median(c / f for c, f in zip(times[name], free))
        check_ms = mean_ms(lambda: StructuredOutput(json=schema))
        matcher_ms = mean_ms(lambda: llguidance.LLMatcher(lt, configs[name].grammar_text))
        print(f"  {name}: decode step median {statistics.median(times[name]):.1f} ms, "
              f"{ratio - 1:+.1%} against the free step beside it (median over steps); schema "
              f"compiled and checked in {check_ms:.2f} ms, matcher built in {matcher_ms:.2f} ms "
              f"({len(json.dumps(schema))} bytes)")


if __name__ == "__main__":
    main()
