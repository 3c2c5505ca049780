"""Batched sampling: one set of tensor ops for the whole batch, each row with its own
parameters. The only per-request Python is drawing seeded noise, because a seeded
request must get the same random numbers whatever else is in its batch.

On a GPU nothing here waits for the device before the sampled ids are read: which filters
run and how wide they are is decided from the Python parameters, per-row values are built
on the host and copied without blocking, and penalty counts are built on the device.
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


def _to(values: list | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values on ``device``: built on the host (the dtype torch.tensor gives them) and
    copied without making the host wait for the device; the same tensor on the CPU."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    return host.to(device, non_blocking=True)


def _reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on the host costs no wait for a device (the CPU)."""
    return device.type == "cpu"


def sample(logits: torch.Tensor, batch: SamplingBatch,
           argmax: Callable[[torch.Tensor], torch.Tensor] = _argmax,
           race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
    """``logits``: [B, V], one row per request in ``batch``, in any float dtype. ``argmax``
    gives each row's first largest index (the model's ops may have a faster one than
    torch's). A batch of plain greedy picks takes the argmax of the logits as they are
    (widening to float32 is exact, so the pick is the same); everything else is computed
    in float32. ``race(scores, seeds)``, when given (a native or Triton kernel), draws each row
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
    greedy = _to([p.greedy for p in params], dev)
    temps = _to([1.0 if p.greedy else p.temperature for p in params], dev)
    scaled = logits / temps.unsqueeze(1)
    scaled = _apply_top_k_top_p_min_p(scaled, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    if race is not None:
        sampled = race(scaled.contiguous(), _to(_row_seeds(params, batch.output_token_ids), dev))
    else:
        probs = torch.softmax(scaled, dim=-1)
        noise = _to(_exponential_noise(params, batch.output_token_ids, b, vocab), dev)
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
    dev = logits.device
    out_counts = _token_counts(batch.output_token_ids, logits.shape, dev)
    prompt_seen = _token_counts(batch.prompt_token_ids, logits.shape, dev) > 0
    rep = _to([p.repetition_penalty for p in batch.params], dev).unsqueeze(1)
    pres = _to([p.presence_penalty for p in batch.params], dev).unsqueeze(1)
    freq = _to([p.frequency_penalty for p in batch.params], dev).unsqueeze(1)
    # Repetition penalty (CTRL / HF semantics) over prompt and output tokens.
    seen = prompt_seen | (out_counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    # Presence and frequency penalties (OpenAI semantics) over output tokens only.
    logits = logits - freq * out_counts - pres * (out_counts > 0).float()
    return logits


def _token_counts(seqs: list[list[int]], shape: torch.Size, dev: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's sequence, [B, V] float32 on ``dev``: the
    (row, token) pairs go over as one index tensor, the counts are made where they are used."""
    counts = torch.zeros(shape, device=dev)
    lengths = [len(s) for s in seqs]
    if sum(lengths):
        rows = torch.repeat_interleave(torch.arange(shape[0]), torch.tensor(lengths))
        cols = torch.tensor([t for s in seqs for t in s])
        if not _reads_are_free(dev):
            rows, cols = _to(torch.stack([rows, cols]), dev)
        counts.index_put_((rows, cols), torch.ones(len(cols), device=dev), accumulate=True)
    return counts


def _block_eos_before_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Rows that have not reached min_tokens may not end: EOS and stop tokens get -inf."""
    logits = logits.clone()
    rows, cols = [], []
    for row, p in enumerate(batch.params):
        if len(batch.output_token_ids[row]) < p.min_tokens:
            enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(batch.eos_token_ids))
            rows += [row] * len(enders)
            cols += sorted(enders)
    if rows:  # one indexed write (a Python list as an index would copy, and wait, per row)
        index = _to([rows, cols], logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Which filters run, and over how many candidates, is decided from the parameters, not
    from tensors (no device read)."""
    vocab = logits.shape[1]
    dev = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    max_k = max((k for k in ks if k < vocab), default=0)
    nucleus_only = any(p.top_p < 1.0 and k == vocab for p, k in zip(params, ks))
    if max_k or any(p.top_p < 1.0 for p in params):
        top_k, top_p = _to(ks, dev), _to([p.top_p for p in params], dev)
        logits = _filter_top_candidates(logits, top_k, top_p, max_k, nucleus_only)
    if any(p.min_p > 0 for p in params):
        min_p = _to([p.min_p for p in params], dev)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# Candidates sorted for top-k/top-p on the CPU: a full sort of [B, V] is slow there.
_CANDIDATES = 256


def _filter_top_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           max_k: int, nucleus_only: bool) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix of them whose probability (over
    the kept ones) reaches top_p. ``max_k``: the largest top_k below the vocabulary (0: none);
    ``nucleus_only``: whether a row has top_p without top_k. On the CPU only the best
    candidates are sorted (torch.topk), and a row whose nucleus does not end among them (a
    flat distribution) sends the batch to a full sort. That check reads the tensors, so on a
    device a batch with a top_p-only row sorts in full at once, and one without takes the
    top max_k. The result is exact either way."""
    vocab = logits.shape[1]
    with_k = top_k < vocab
    filtered = with_k | (top_p < 1.0)
    probe = _reads_are_free(logits.device)
    k = min(vocab, max(_CANDIDATES, max_k)) if probe else (vocab if nucleus_only else max_k)
    if probe or k < vocab:
        vals, order = logits.topk(k, dim=-1)  # descending
    else:
        vals, order = logits.sort(dim=-1, descending=True)
    drop, probs = _prefix_probs(logits, vals, top_k, with_k)
    if probe and k < vocab and not bool((with_k | (probs.sum(dim=-1) >= top_p) | ~filtered).all()):
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
    """A seed per row for the race kernels: from (seed, index of the token being drawn) when
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
