"""The sampler's path for logits on a device: nothing read back before the sampled ids,
penalty counts built where the logits are, top-k/top-p exact without the CPU's probe.

Without a GPU, the "meta" device stands in: its tensors have shapes and no values, so any
read of a value on the host (``bool``, ``int``, ``.item()``) raises, as a device read would
make the host wait."""

from __future__ import annotations

import pytest
import torch

from travelator.model import sampler
from travelator.model.sampler import SamplingBatch
from travelator.sampling_params import SamplingParams


@pytest.fixture(params=[True, False], ids=["cpu-path", "device-path"])
def reads_free(request, monkeypatch):
    """Runs the test on the CPU's path and, with the same CPU tensors, on the device's."""
    monkeypatch.setattr(sampler, "_reads_are_free", lambda device: request.param)
    return request.param


def _penalty_batch() -> SamplingBatch:
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    return SamplingBatch(params, prompt_token_ids=[[1, 1, 2], [5]], output_token_ids=[[2, 2, 3], [0, 5, 5]])


def test_penalty_counts_and_logits_match_a_hand_computed_expectation(reads_free):
    batch = _penalty_batch()
    counts = sampler._token_counts(batch.output_token_ids, torch.Size((2, 6)), torch.device("cpu"))
    assert counts.tolist() == [[0, 0, 2, 1, 0, 0], [1, 0, 0, 0, 0, 2]]
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0],
                           [0.0, -1.0, 4.0, 1.0, -3.0, 2.0]])
    got = sampler._apply_penalties(logits.clone(), batch)
    # Row 0: tokens 1, 2, 3 seen (repetition 2: positive / 2, negative * 2); in the output,
    # token 2 twice and token 3 once (frequency 0.25 per occurrence, presence 0.5).
    # Row 1: tokens 0 and 5 seen, repetition 1.5 only (0 stays 0).
    want = torch.tensor([[1.0, 2.0 / 2, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0, -2.0],
                         [0.0, -1.0, 4.0, 1.0, -3.0, 2.0 / 1.5]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_min_tokens_blocks_every_ender_of_each_row_in_one_write(reads_free):
    logits = torch.zeros(3, 8)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5, 6]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[4]),
              SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[3])]
    batch = SamplingBatch(params, [[]] * 3, [[], [9], [9]], frozenset({0, 1}))
    got = sampler._block_eos_before_min_tokens(logits, batch)
    blocked = [torch.isinf(r).nonzero().flatten().tolist() for r in got]
    assert blocked == [[0, 1, 5, 6], [4], []]


def _kept_by_definition(logits, top_k, top_p):
    """Each row's top_k, then the smallest prefix whose probability over them reaches top_p."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        vals, order = logits[r].sort(descending=True)
        k = top_k[r] if 0 < top_k[r] < logits.shape[1] else logits.shape[1]
        probs = torch.softmax(vals[:k].double(), dim=0)
        kept[r, order[:max(int((probs.cumsum(0) - probs < top_p[r]).sum()), 1)]] = True
    return kept


@pytest.mark.parametrize("top_k,top_p", [
    ([0, 5, 300, 0, 1, 40], [1.0, 1.0, 0.5, 1.0, 1.0, 0.3]),  # top-k only or both: the top max_k
    ([0, 5, 0, 0, 1, 40], [0.9, 1.0, 0.99, 0.2, 1.0, 0.3]),  # top_p-only rows: a full sort
])
@pytest.mark.parametrize("sharpness", [0.1, 8.0])
def test_top_k_top_p_are_exact_on_both_paths(reads_free, top_k, top_p, sharpness):
    g = torch.Generator().manual_seed(int(sharpness * 10))
    logits = torch.randn(6, 3000, generator=g) * sharpness
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(top_k, top_p)]
    got = sampler._apply_top_k_top_p_min_p(logits.clone(), params)
    kept = torch.isfinite(got)
    assert torch.equal(kept, _kept_by_definition(logits, top_k, top_p))
    assert torch.equal(got[kept], logits[kept])


def _mixed_batch(vocab: int) -> SamplingBatch:
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=3),
              SamplingParams(temperature=0.5, top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3,
                             frequency_penalty=0.1, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.8),
              SamplingParams(temperature=0)]
    return SamplingBatch(params, [[1, 2], [3, 4, 4], [], [9]], [[5], [6, 6], [vocab - 1], []], frozenset({0}))


@pytest.mark.parametrize("race", [True, False], ids=["race", "torch-noise"])
def test_the_sampler_reads_nothing_back_from_a_device(race):
    """Every filter, penalties, min_tokens and the draw, on meta logits: a host read of any
    value on the way (a data-dependent branch or width) would raise."""
    vocab = 300
    batch = _mixed_batch(vocab)
    logits = torch.empty(4, vocab, device="meta")
    with pytest.raises(RuntimeError):
        bool(logits.sum() > 0)  # what a read of a value does here
    x = sampler._apply_penalties(logits.clone(), batch)
    x = sampler._block_eos_before_min_tokens(x, batch)
    draw = (lambda scores, seeds: scores.argmax(dim=-1)) if race else None
    ids = sampler._draw(x, batch, sampler._argmax, draw)
    assert ids.device.type == "meta" and ids.shape == (4,)
    top_p_only = [SamplingParams(temperature=1.0, top_p=0.5)] * 4  # the full-sort branch
    assert sampler._apply_top_k_top_p_min_p(logits, top_p_only).shape == (4, vocab)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_synchronisation_on_a_gpu():
    """On a real device, with torch's sync check raising: the whole draw, filters, penalties
    and the Triton race included, queues its work without waiting once."""
    from travelator.kernels.triton_sampling import exponential_race

    vocab = 32000
    batch = _mixed_batch(vocab)
    logits = torch.randn(4, vocab, device="cuda")
    exponential_race(logits, torch.zeros(4, dtype=torch.long, device="cuda"))  # compiled before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = sampler._apply_penalties(logits.clone(), batch)
        x = sampler._block_eos_before_min_tokens(x, batch)
        ids = sampler._draw(x, batch, sampler._argmax, exponential_race)
        sampler._apply_top_k_top_p_min_p(logits, [SamplingParams(temperature=1.0, top_p=0.5)] * 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.shape == (4,) and ids.device.type == "cuda"
