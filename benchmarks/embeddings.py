"""Embeddings throughput alone and beside decodes, and what embeddings cost the decodes.

One engine (travelator's defaults unless ``--option`` says otherwise), three phases, each
``--repeats`` times in turn:

- **embed alone**: ``--inputs`` prompts of ``--input-tokens`` random tokens, all submitted at
  once, embedded (last-token pooling): inputs per second until the last is done.
- **decode alone**: ``--decodes`` requests decoding (16-token prompts, greedy, no EOS); once
  all have their first token, the gaps between each request's tokens (inter-token latency,
  ITL) over the next ``--window-steps`` steps, and each request's mean gap in that window (its
  TPOT): p50 and p99 of each, over every repeat.
- **both**: the same decodes, and once all have their first token the embeddings submitted
  at once: inputs per second until the last embedding is done, and the decodes' ITL and TPOT
  in that time (what a decode waits while prompts share its steps).

    python benchmarks/embeddings.py --model dummy:llama-50m
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import statistics
import time

from travelator import LLM, SamplingParams
from travelator.model.device import cpu_model_name
from travelator.pooling_params import PoolingParams


def _value(text: str):
    """A setting's value: a Python literal (a number, True) or else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Phases:
    def __init__(self, llm: LLM, args: argparse.Namespace) -> None:
        self.engine = llm.engine
        self.args = args
        rng = random.Random(0)
        vocab = self.engine.arch.vocab_size
        self.inputs = [[rng.randrange(3, vocab) for _ in range(args.input_tokens)] for _ in range(args.inputs)]
        self.decode_prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(args.decodes)]

    def _add_embeddings(self) -> set[str]:
        params = SamplingParams(max_tokens=0, pooling=PoolingParams("embed", "last"))
        return {self.engine.add_request(p, params).request_id for p in self.inputs}

    def _add_decodes(self) -> dict[str, list[float]]:
        params = SamplingParams(max_tokens=self.args.max_tokens, temperature=0.0, ignore_eos=True)
        return {self.engine.add_request(p, params).request_id: [] for p in self.decode_prompts}

    def _step(self, token_times: dict[str, list[float]], pending: set[str]) -> None:
        outs = self.engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in token_times and out.new_token_ids:
                token_times[out.request_id].append(now)
            if out.finished:
                pending.discard(out.request_id)

    def embed_alone(self) -> float:
        pending = self._add_embeddings()
        start = time.perf_counter()
        while pending:
            self._step({}, pending)
        return len(self.inputs) / (time.perf_counter() - start)

    def decodes(self, with_embeddings: bool) -> tuple[float | None, dict[str, list[float]]]:
        """(embeddings per second or None, each decode's gaps in the measured window)."""
        times = self._add_decodes()
        decoding = set(times)
        while any(not t for t in times.values()):
            self._step(times, decoding)
        marks = {rid: len(t) for rid, t in times.items()}
        start = time.perf_counter()
        rate = None
        if with_embeddings:
            pending = self._add_embeddings()
            while pending:
                self._step(times, pending)
            rate = len(self.inputs) / (time.perf_counter() - start)
        else:
            for _ in range(self.args.window_steps):
                self._step(times, decoding)
        gaps = {rid: [b - a for a, b in zip(t[marks[rid] - 1:], t[marks[rid]:])] for rid, t in times.items()}
        self.engine.abort_request(list(decoding))
        while self.engine.scheduler.requests:
            self.engine.step()
        return rate, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4000, help="enough to outlast a phase")
    ap.add_argument("--window-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting, e.g. dtype=float32 (repeatable)")
    args = ap.parse_args()
    options = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.option)}
    llm = LLM(args.model, max_model_len=4096, **options)
    print(f"# {cpu_model_name()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.model}, "
          f"{args.inputs} inputs x {args.input_tokens} tokens, {args.decodes} decodes; options {options or 'none'}")
    phases = Phases(llm, args)
    phases.embed_alone()  # warm-up: kernels, allocator
    alone, both, gaps = [], [], {False: [], True: []}
    for r in range(args.repeats):
        alone.append(phases.embed_alone())
        for with_embeddings in (False, True):
            rate, per_request = phases.decodes(with_embeddings)
            gaps[with_embeddings] += per_request.values()
            if rate is not None:
                both.append(rate)
        print(f"repeat {r}: embed alone {alone[-1]:.1f} inputs/s, beside decodes {both[-1]:.1f} inputs/s")
    print(f"embeddings alone: {statistics.median(alone):.1f} inputs/s (median of {args.repeats})")
    print(f"embeddings beside {args.decodes} decodes: {statistics.median(both):.1f} inputs/s")
    for with_embeddings, label in ((False, "alone"), (True, "while embeddings run")):
        itl = [g for request in gaps[with_embeddings] for g in request]
        tpot = [statistics.fmean(request) for request in gaps[with_embeddings] if request]
        print(f"decodes {label}: ITL p50 {_quantile(itl, 0.5) * 1e3:.1f} ms, p99 {_quantile(itl, 0.99) * 1e3:.1f} ms; "
              f"TPOT p50 {_quantile(tpot, 0.5) * 1e3:.1f} ms, p99 {_quantile(tpot, 0.99) * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
