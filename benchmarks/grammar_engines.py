"""llguidance (the engine's grammar library) against xgrammar on this CPU: compile time per
JSON schema and the time to fill 32 rows' token masks, over a walk of 60 steps.

Both engines get the same tokenizer (the byte-level 32k vocabulary of ``dummy:llama-50m``),
JSON without free whitespace, one call per row, one thread; they take turns repeat by repeat,
and each step every row takes the first allowed token after a random id (the same draw for
both, so they walk the same paths), picking structure (quote, comma, brackets, EOS) a quarter
of the time so rows leave their strings. xgrammar is not a dependency: run this in an
environment that has it,

    python -m venv /tmp/xgr && /tmp/xgr/bin/pip install torch==2.13.0 xgrammar llguidance tokenizers
    PYTHONPATH=. /tmp/xgr/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from importlib.metadata import version

import llguidance
import llguidance.torch
import torch
import xgrammar

from travelator.model.device import cpu_model_name
from travelator.model.tokenizer import Tokenizer

VOCAB, BATCH, STEPS = 32000, 32, 60
SCHEMAS = {
    "free strings": {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"], "additionalProperties": False},
    "bounded strings": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 400},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 50}},
        "required": ["name", "tags"], "additionalProperties": False},
}


class Llguidance:
    def __init__(self, tk: Tokenizer) -> None:
        self.tokenizer = llguidance.LLTokenizer(tk.backend.to_str(), n_vocab=VOCAB, eos_token=sorted(tk.eos_token_ids))

    def compile(self, schema: dict):
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

    def matchers(self, grammar, n: int = BATCH) -> list:
        return [llguidance.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def fill(self, matchers, masks) -> None:
        for k, m in enumerate(matchers):
            if not m.is_stopped():
                llguidance.torch.fill_next_token_bitmask(m, masks, k)

    @staticmethod
    def advance(matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    def __init__(self, tk: Tokenizer) -> None:
        vocab = [tk.backend.id_to_token(i) or "" for i in range(VOCAB)]
        vocab = ["" if i < 3 else v for i, v in enumerate(vocab)]  # specials are not text
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_FALLBACK, vocab_size=VOCAB,
                                      stop_token_ids=sorted(tk.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def matchers(self, grammar, n: int = BATCH) -> list:
        return [xgrammar.GrammarMatcher(grammar) for _ in range(n)]

    def fill(self, matchers, masks) -> None:
        for k, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(masks, k)

    @staticmethod
    def advance(matcher, token: int) -> None:
        assert matcher.accept_token(token)


def allowed(masks: torch.Tensor, row: int) -> list[int]:
    bits = masks[row].numpy().view("uint32")
    return [i for i in range(VOCAB) if bits[i >> 5] >> (i & 31) & 1]


def walk(engine, grammar, structure: set[int], seed: int) -> list[float]:
    """Fill times (ms) of the 32 rows' masks over the steps after the first."""
    matchers, rng = engine.matchers(grammar), random.Random(seed)
    masks = llguidance.torch.allocate_token_bitmask(BATCH, VOCAB)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        engine.fill(matchers, masks)
        times.append((time.perf_counter() - t0) * 1e3)
        for k, m in enumerate(matchers):
            ok = allowed(masks, k)
            if not ok or (hasattr(m, "is_stopped") and m.is_stopped()) or (
                    hasattr(m, "is_terminated") and m.is_terminated()):
                continue
            pool = [t for t in ok if t in structure] if rng.random() < 0.25 else []
            pick = rng.randrange(VOCAB)
            token = min(pool or ok, key=lambda t: (t - pick) % VOCAB)
            engine.advance(m, token)
    return times[1:]


def main() -> None:
    tk = Tokenizer.byte_level(VOCAB)
    structure = {t for t in range(VOCAB) if tk.decode([t]) in ('"', ",", "]", "}", ", ")} | set(tk.eos_token_ids)
    engines = {"llguidance": Llguidance(tk), "xgrammar": Xgrammar(tk)}
    print(f"{cpu_model_name()}, load average {os.getloadavg()[0]:.2f}; llguidance {version('llguidance')}, "
          f"xgrammar {version('xgrammar')}; {BATCH} rows, {STEPS} steps, vocabulary {VOCAB}")
    for name, schema in SCHEMAS.items():
        compile_ms = {e: [] for e in engines}
        fill_ms = {e: [] for e in engines}
        for repeat in range(3):
            for label, engine in engines.items():
                t0 = time.perf_counter()
                grammar = engine.compile(schema)
                matcher = engine.matchers(grammar, 1)[0]
                engine.fill([matcher], llguidance.torch.allocate_token_bitmask(1, VOCAB))
                compile_ms[label].append((time.perf_counter() - t0) * 1e3)
                fill_ms[label] += walk(engine, grammar, structure, seed=repeat)
        for label in engines:
            fill = statistics.median(fill_ms[label])
            print(f"  {name}, {label}: compile + first mask {statistics.median(compile_ms[label]):.2f} ms; "
                  f"fill {fill:.2f} ms per {BATCH} rows ({fill / BATCH * 1e3:.1f} us a row)")


if __name__ == "__main__":
    main()
