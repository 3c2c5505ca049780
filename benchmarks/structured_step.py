"""What a grammar costs a decode step: 32 requests under a JSON schema against 32 free ones.

Both batches decode on the same engine settings; the constrained one pays for filling one
token mask per row and applying it before sampling. Whole engine steps, medians. Also the
time to compile the schema into a matcher (llguidance).

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

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 400},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 50}},
    "required": ["name", "tags"], "additionalProperties": False}


def decode_step_ms(llm: LLM, structured: StructuredOutput | None, batch: int, steps: int) -> float:
    engine = llm.engine
    for i in range(batch):
        engine.add_request([1] + [3 + (i * 7 + k) % 200 for k in range(31)],
                           SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True,
                                          structured=structured))
    while engine.last_step is None or engine.last_step.num_decodes != batch:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_request([rid for rid in list(engine.scheduler.requests)])
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, enable_prefix_caching=False)
    structured = StructuredOutput(json=SCHEMA)
    free = decode_step_ms(llm, None, args.batch, args.steps)
    constrained = decode_step_ms(llm, structured, args.batch, args.steps)
    free2 = decode_step_ms(llm, None, args.batch, args.steps)
    tk = llm.engine.tokenizer
    lt = llguidance.LLTokenizer(tk.backend.to_str(), n_vocab=llm.engine.arch.vocab_size,
                                eos_token=sorted(tk.eos_token_ids))
    t0 = time.perf_counter()
    for _ in range(20):
        llguidance.LLMatcher(lt, structured.grammar_text)
    compile_ms = (time.perf_counter() - t0) / 20 * 1e3
    base = statistics.mean([free, free2])
    print(f"{args.model} {args.dtype}, {args.batch} requests, load average {os.getloadavg()[0]:.2f}: "
          f"decode step free {free:.1f} / {free2:.1f} ms, under a JSON schema {constrained:.1f} ms "
          f"({constrained / base - 1:+.1%}); schema compile {compile_ms:.2f} ms "
          f"({len(json.dumps(SCHEMA))} bytes of schema)")


if __name__ == "__main__":
    main()
