"""Benchmark workloads: prompt token ids and forced output lengths, from a seed.

Every workload is a list of :class:`RequestSpec`. Prompts are random token ids (the
engine's speed does not depend on which tokens they are), and every output is forced
to its length with ``ignore_eos`` so that schedulers are compared on the same work.

Three kinds:

``orca``
    The synthetic trace of the Orca paper (Yu et al., OSDI 2022, section 6): prompt and
    output lengths uniform in given ranges. The paper's ranges, as summarised in
    secondary sources (e.g. moe-inference.readthedocs.io "Evaluation plan"), are
    [32, 512] prompt tokens and [1, 128] output tokens; those are the defaults.

``conversational``
    Heavy-tailed lengths drawn from log-normal distributions. We did not fit these to a
    trace ourselves: the parameters are *chosen* to resemble the ShareGPT statistics
    that serving papers commonly report (e.g. the vLLM paper, Kwon et al. SOSP 2023,
    section 6.1 and its length histograms): prompts with a mean of about 160 tokens
    and a long right tail, outputs with a mean of about 340 tokens, both right-skewed
    with a median well below the mean. The targets we used are the means and a
    median/mean ratio of roughly 0.6-0.75; see :data:`CONVERSATIONAL` for the values.
    Treat it as "ShareGPT-like", not as a fitted model of any trace.

``fixed``
    Every request has the same prompt and output length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

# The lowest token id used in random prompts: ids 0-2 are unk/bos/eos in most
# Llama-family vocabularies (and in the dummy presets), so they are avoided.
FIRST_PROMPT_TOKEN_ID = 3


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal length distribution given by its median and sigma (of the log)."""

    median: float
    sigma: float

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)


# ShareGPT-like, see the module docstring. Prompt mean = 97 * e^(1.0^2/2) ~ 160 tokens
# (median/mean ~ 0.61); output mean = 250 * e^(0.78^2/2) ~ 340 tokens (median/mean ~ 0.74).
CONVERSATIONAL = {
    "prompt": LogNormal(median=97.0, sigma=1.0),
    "output": LogNormal(median=250.0, sigma=0.78),
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Workload:
    kind: str
    seed: int
    requests: list[RequestSpec]
    params: dict = field(default_factory=dict)  # how it was generated, for the report

    def __len__(self) -> int:
        return len(self.requests)

    def salted(self, salt: int) -> "Workload":
        """The same lengths, with every prompt's first token shifted by ``salt``.

        Replaying a workload (the next rate of a sweep) against an engine with prefix
        caching would otherwise hit the blocks the previous run left behind; a changed
        first token changes the hash of every block after it, so a salted replay does
        the same work as the first run. ``salt == 0`` is the workload itself.
        """
        if salt == 0:
            return self
        vocab = self.params["vocab_size"]
        low = FIRST_PROMPT_TOKEN_ID if vocab > FIRST_PROMPT_TOKEN_ID + 1 else 0
        span = vocab - low
        reqs = [RequestSpec([low + (r.prompt_token_ids[0] - low + salt) % span,
                             *r.prompt_token_ids[1:]], r.output_len) for r in self.requests]
        return Workload(self.kind, self.seed, reqs, dict(self.params, salt=salt))

    def summary(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        return {
            "kind": self.kind,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "params": self.params,
            "prompt_len": _describe(p),
            "output_len": _describe(o),
            "total_prompt_tokens": int(p.sum()),
            "total_output_tokens": int(o.sum()),
        }


def _describe(a: np.ndarray) -> dict:
    if a.size == 0:
        return {}
    return {
        "mean": round(float(a.mean()), 2),
        "median": float(np.median(a)),
        "min": int(a.min()),
        "max": int(a.max()),
    }


def _prompts(rng: np.random.Generator, lengths, vocab_size: int) -> list[list[int]]:
    low = FIRST_PROMPT_TOKEN_ID if vocab_size > FIRST_PROMPT_TOKEN_ID + 1 else 0
    return [rng.integers(low, vocab_size, size=int(n)).tolist() for n in lengths]


def _fit(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Clip a request so that prompt + output fits the context (prompt first)."""
    prompt_len, output_len = max(1, prompt_len), max(1, output_len)
    if max_model_len is not None and prompt_len + output_len > max_model_len:
        if max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        prompt_len = min(prompt_len, max_model_len - 1)
        output_len = min(output_len, max_model_len - prompt_len)
    return prompt_len, output_len


def _build(kind: str, seed: int, rng: np.random.Generator, prompt_lens, output_lens,
           vocab_size: int, max_model_len: int | None, params: dict) -> Workload:
    fitted = [_fit(int(p), int(o), max_model_len) for p, o in zip(prompt_lens, output_lens)]
    prompts = _prompts(rng, [p for p, _ in fitted], vocab_size)
    reqs = [RequestSpec(ids, o) for ids, (_, o) in zip(prompts, fitted)]
    return Workload(kind, seed, reqs, dict(params, vocab_size=vocab_size,
                                           max_model_len=max_model_len))


def orca_synthetic(
    num_requests: int,
    *,
    vocab_size: int,
    prompt_len_range: tuple[int, int] = (32, 512),
    output_len_range: tuple[int, int] = (1, 128),
    seed: int = 0,
    max_model_len: int | None = None,
) -> Workload:
    """Prompt and output lengths uniform in the given inclusive ranges."""
    _check_range("prompt", prompt_len_range)
    _check_range("output", output_len_range)
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, size=num_requests)
    o = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_requests)
    params = {"prompt_len_range": list(prompt_len_range), "output_len_range": list(output_len_range)}
    return _build("orca", seed, rng, p, o, vocab_size, max_model_len, params)


def conversational(
    num_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    prompt: LogNormal = CONVERSATIONAL["prompt"],
    output: LogNormal = CONVERSATIONAL["output"],
    max_prompt_len: int = 2048,
    max_output_len: int = 2048,
    max_model_len: int | None = None,
) -> Workload:
    """Heavy-tailed, ShareGPT-like lengths (log-normal, clipped to [1, max])."""
    rng = np.random.default_rng(seed)
    p = np.clip(np.rint(prompt.sample(rng, num_requests)), 1, max_prompt_len)
    o = np.clip(np.rint(output.sample(rng, num_requests)), 1, max_output_len)
    params = {
        "prompt_lognormal": asdict(prompt), "output_lognormal": asdict(output),
        "max_prompt_len": max_prompt_len, "max_output_len": max_output_len,
    }
    return _build("conversational", seed, rng, p, o, vocab_size, max_model_len, params)


def fixed(
    num_requests: int,
    *,
    vocab_size: int,
    prompt_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
    max_model_len: int | None = None,
) -> Workload:
    if prompt_len < 1 or output_len < 1:
        raise ValueError("fixed lengths must be positive")
    rng = np.random.default_rng(seed)
    p = [prompt_len] * num_requests
    o = [output_len] * num_requests
    params = {"prompt_len": prompt_len, "output_len": output_len}
    return _build("fixed", seed, rng, p, o, vocab_size, max_model_len, params)


def decodes_and_long_prompts(
    *,
    vocab_size: int,
    num_decodes: int,
    decode_prompt_len: int,
    decode_output_len: int,
    num_long: int,
    long_prompt_len: int,
    long_output_len: int,
    seed: int = 0,
) -> Workload:
    """The interference workload: ``num_decodes`` short prompts with long outputs (the steady
    decodes), then ``num_long`` long prompts with short outputs, in that order."""
    if min(num_decodes, decode_prompt_len, decode_output_len, long_prompt_len, long_output_len) < 1 or num_long < 0:
        raise ValueError("the interference workload needs positive counts and lengths")
    rng = np.random.default_rng(seed)
    p = [decode_prompt_len] * num_decodes + [long_prompt_len] * num_long
    o = [decode_output_len] * num_decodes + [long_output_len] * num_long
    params = {"num_decodes": num_decodes, "decode_prompt_len": decode_prompt_len,
              "decode_output_len": decode_output_len, "num_long": num_long,
              "long_prompt_len": long_prompt_len, "long_output_len": long_output_len}
    return _build("interference", seed, rng, p, o, vocab_size, None, params)


WORKLOADS = ("orca", "conversational", "fixed")


def make_workload(kind: str, num_requests: int, *, vocab_size: int, seed: int = 0,
                  max_model_len: int | None = None, **kw) -> Workload:
    """Build a workload by name; ``kw`` are the keyword arguments of that generator."""
    if num_requests < 1:
        raise ValueError("num_requests must be positive")
    gen = {"orca": orca_synthetic, "conversational": conversational, "fixed": fixed}.get(kind)
    if gen is None:
        raise ValueError(f"unknown workload {kind!r}; choose one of {WORKLOADS}")
    return gen(num_requests, vocab_size=vocab_size, seed=seed, max_model_len=max_model_len, **kw)


def _check_range(name: str, r: tuple[int, int]) -> None:
    lo, hi = r
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} length range must satisfy 1 <= min <= max, got {lo}..{hi}")
