"""Batched sampling: one set of tensor ops for the whole batch, each row with its own
parameters. The only per-request Python is drawing seeded noise, because a seeded
request must get the same random numbers whatever else is in its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from travelator.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of the requests sampled in one step."""

    params: list[SamplingParams]
    # Tokens already in each sequence (prompt + output) and the output alone, for penalties.
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each sampled token
    top_logprobs: list[dict[int, float]] | None


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           argmax: Callable[[torch.Tensor], torch.Tensor] = _argmax,
           race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
    """``logits``: [B, V], one row per request in ``batch``, in any float dtype. ``argmax``
    gives each row's first largest index (the model's ops may have a faster one than
    torch's). A batch of plain greedy picks takes the argmax of the logits as they are
    (widening to float32 is exact, so the pick is the same); everything else is computed
    in float32. ``race(scores, seeds)``, when given (the native kernel), draws each row
    from softmax(scores) with noise generated from the row's seed alone; otherwise torch
    generators make the noise (a different stream: seeded outputs are reproducible per
    kernel set)."""
    params = batch.params
    want_logprobs = any(p.logprobs is not None for p in params)
    all_greedy = all(p.greedy for p in params)
    if (want_logprobs or not all_greedy or any(p.uses_penalties for p in params)
            or any(p.min_tokens for p in params)):
        logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    if any(p.uses_penalties for p in params):
        logits = _apply_penalties(logits.clone(), batch)
    if any(p.min_tokens for p in params):
        logits = _block_eos_before_min_tokens(logits, batch)

    if all_greedy:  # decided in Python: a tensor of flags and its .all() cost more than the argmax
        token_ids = argmax(logits)
    else:
        token_ids = _draw(logits, batch, argmax, race)
    ids = token_ids.tolist()
    if not want_logprobs:
        return SamplerOutput(ids, None, None)
    return _with_logprobs(ids, token_ids, raw_logprobs, params)


def _draw(logits: torch.Tensor, batch: SamplingBatch, argmax: Callable[[torch.Tensor], torch.Tensor],
          race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Each row's token: greedy rows their argmax, the others a draw from their filtered,
    temperature-scaled distribution."""
    params = batch.params
    b, vocab = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    scaled = logits / temps.unsqueeze(1)
    scaled = _apply_top_k_top_p_min_p(scaled, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    if race is not None:
        sampled = race(scaled.contiguous(), _row_seeds(params, batch.output_token_ids).to(dev))
    else:
        probs = torch.softmax(scaled, dim=-1)
        noise = _exponential_noise(params, batch.output_token_ids, b, vocab).to(dev)
        sampled = argmax(probs / noise)
    return torch.where(greedy, argmax(logits), sampled)


def _with_logprobs(ids: list[int], token_ids: torch.Tensor, raw_logprobs: torch.Tensor,
                   params: list[SamplingParams]) -> SamplerOutput:
    """The picks with their logprobs and each row's top ``logprobs`` alternatives."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(p.logprobs or 0 for p in params)
    tops: list[dict[int, float]] = [{} for _ in range(len(params))]
    if k:
        vals, idx = raw_logprobs.topk(k, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        for row, p in enumerate(params):
            n = p.logprobs or 0
            tops[row] = dict(zip(idx[row][:n], vals[row][:n]))
    return SamplerOutput(ids, chosen, tops)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    b, vocab = logits.shape
    out_counts = _token_counts(batch.output_token_ids, b, vocab)
    prompt_seen = _token_counts(batch.prompt_token_ids, b, vocab) > 0
    dev = logits.device
    out_counts, prompt_seen = out_counts.to(dev), prompt_seen.to(dev)
    rep = torch.tensor([p.repetition_penalty for p in batch.params], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in batch.params], device=dev).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in batch.params], device=dev).unsqueeze(1)
    # Repetition penalty (CTRL / HF semantics) over prompt and output tokens.
    seen = prompt_seen | (out_counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    # Presence and frequency penalties (OpenAI semantics) over output tokens only.
    logits = logits - freq * out_counts - pres * (out_counts > 0).float()
    return logits


def _token_counts(seqs: list[list[int]], b: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(b, vocab)
    lengths = [len(s) for s in seqs]
    if sum(lengths):
        rows = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
        cols = torch.tensor([t for s in seqs for t in s])
        counts.index_put_((rows, cols), torch.ones(len(cols)), accumulate=True)
    return counts


def _block_eos_before_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Rows that have not reached min_tokens may not end: EOS and stop tokens get -inf."""
    logits = logits.clone()
    for row, p in enumerate(batch.params):
        if len(batch.output_token_ids[row]) < p.min_tokens:
            enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(batch.eos_token_ids))
            if enders:
                logits[row, sorted(enders)] = float("-inf")
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    b, vocab = logits.shape
    dev = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        logits = _filter_top_candidates(logits, top_k, top_p)
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# Candidates sorted for top-k/top-p: a full sort of [B, V] costs tens of ms on the CPU.
_CANDIDATES = 256


def _filter_top_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix of them whose probability (over
    the kept ones) reaches top_p. Only the best candidates are sorted (torch.topk); a row whose
    nucleus does not end among them (a flat distribution) sends the batch to a full sort, so
    the result is exact either way."""
    vocab = logits.shape[1]
    with_k = top_k < vocab
    filtered = with_k | (top_p < 1.0)
    k = min(vocab, max(_CANDIDATES, int(top_k[with_k].max()) if bool(with_k.any()) else 0))
    vals, order = logits.topk(k, dim=-1)  # descending
    drop, probs = _prefix_probs(logits, vals, top_k, with_k)
    if k < vocab and not bool((with_k | (probs.sum(dim=-1) >= top_p) | ~filtered).all()):
        vals, order = logits.sort(dim=-1, descending=True)
        drop, probs = _prefix_probs(logits, vals, top_k, with_k)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)  # the first token always stays
    kept = torch.full_like(logits, float("-inf")).scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    return torch.where(filtered.unsqueeze(1), kept, logits)


def _prefix_probs(logits, vals, top_k, with_k) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``vals``, each row's best logits in descending order: which fall outside its top_k,
    and their probabilities, over the kept ones for a row with top_k and over the whole
    vocabulary for one without (0 for the dropped ones)."""
    rank = torch.arange(vals.shape[1], device=vals.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    norm = torch.where(with_k.unsqueeze(1), torch.logsumexp(vals.masked_fill(drop, float("-inf")), -1, keepdim=True),
                       torch.logsumexp(logits, -1, keepdim=True))
    return drop, (vals - norm).exp().masked_fill(drop, 0.0)


def _row_seeds(params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """A seed per row for the native race: from (seed, index of the token being drawn) when
    the request has a seed (the same draw however it was batched, chunked or preempted),
    else from torch's global generator."""
    seeds = torch.randint(0, 2**62, (len(params),), dtype=torch.long)
    for row, p in enumerate(params):
        if p.seed is not None:
            seeds[row] = (p.seed * _SEED_MIX + len(outputs[row])) % 2**63
    return seeds


def _exponential_noise(params: list[SamplingParams], outputs: list[list[int]],
                       b: int, vocab: int) -> torch.Tensor:
    noise = torch.empty(b, vocab).exponential_()
    for row, p in enumerate(params):
        if p.seed is not None:
            # Seeded by (seed, index of the token being drawn): the same draw however
            # the request was batched, chunked or preempted.
            g = torch.Generator().manual_seed((p.seed * _SEED_MIX + len(outputs[row])) % 2**63)
            noise[row] = torch.empty(vocab).exponential_(generator=g)
    return noise.clamp_min_(1e-10)
