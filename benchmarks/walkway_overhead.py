"""What the live view costs the step thread: ``WalkwayRecorder.record`` after every step of a
full batch, against the step itself (and the JSON encoding of the record, which the server does
on the event loop, not the step thread, but on the same cores).

Workload W's shape (64 requests, prompts 16-256 tokens, outputs 8-256, all present at the
start), offline, the recorder hooked after each step as the server hooks it.

    python benchmarks/walkway_overhead.py --model dummy:llama-50m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from travelator import LLM, SamplingParams
from travelator.dashboard.walkway import WalkwayRecorder
from travelator.model.device import cpu_model_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    for _ in range(args.num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(8, 256), ignore_eos=True, temperature=0.0))
    recorder = WalkwayRecorder(engine)
    steps, records, encodes, seats = [], [], [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        record = recorder.record(outputs)
        t2 = time.perf_counter()
        json.dumps(record, separators=(",", ":"))
        t3 = time.perf_counter()
        steps.append(t1 - t0)
        records.append(t2 - t1)
        encodes.append(t3 - t2)
        seats.append(len(record["seats"]))

    def us(xs):
        return statistics.median(xs) * 1e6

    full = [i for i, n in enumerate(seats) if n >= args.max_num_seqs * 3 // 4]
    print(f"{cpu_model_name()}, load average {os.getloadavg()[0]:.2f}, "
          f"{len(steps)} steps, {len(full)} with >= 3/4 of the seats busy")
    for name, idx in (("all steps", range(len(steps))), ("busy steps", full)):
        st, rec, enc = ([xs[i] for i in idx] for xs in (steps, records, encodes))
        print(f"{name:10s}: step {us(st) / 1000:.2f} ms, record {us(rec):.0f} us "
              f"({statistics.median(r / s for r, s in zip(rec, st)):.2%} of the step), "
              f"JSON {us(enc):.0f} us ({statistics.median(e / s for e, s in zip(enc, st)):.2%})")
    print(f"recorder total {sum(records):.3f} s of {sum(steps):.3f} s stepping "
          f"({sum(records) / sum(steps):.2%}); JSON {sum(encodes):.3f} s ({sum(encodes) / sum(steps):.2%})")


if __name__ == "__main__":
    main()
