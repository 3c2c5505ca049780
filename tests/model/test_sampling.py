"""Sampling: seeds independent of the batch, filters, penalties against transformers'
own logits processors, stop conditions."""

from __future__ import annotations

import pytest
import torch

from paths import STORIES, needs_stories
from travelator import LLM, SamplingParams
from travelator.model.sampler import SamplingBatch, sample

pytestmark = needs_stories


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES), dtype="float32")


def test_seed_gives_same_text_alone_and_in_a_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=1234)
    alone = llm.generate("Sam wanted to", p, use_tqdm=False)[0].text
    others = [SamplingParams(temperature=1.0, max_tokens=20 + i) for i in range(5)]
    batch = llm.generate(["Tom", "Sam wanted to", "A dog", "Lily", "The sun", "Once"],
                         [others[0], p, *others[1:]], use_tqdm=False)
    assert batch[1].text == alone
    other_seed = llm.generate("Sam wanted to", SamplingParams(temperature=1.0, top_p=0.95,
                              max_tokens=30, seed=99), use_tqdm=False)[0].text
    assert other_seed != alone


def test_n_samples_differ_and_are_reproducible(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=7)
    a = [c.text for c in llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs]
    b = [c.text for c in llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs]
    assert a == b and len(set(a)) == 3


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_narrow_filters_equal_greedy(llm, kw):
    greedy = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=25), use_tqdm=False)
    sampled = llm.generate("The cat", SamplingParams(temperature=1.5, max_tokens=25, **kw),
                           use_tqdm=False)
    assert sampled[0].token_ids == greedy[0].token_ids


def test_sampling_follows_the_distribution():
    # Two tokens with probabilities 0.8 / 0.2 after temperature 1: the empirical share
    # over many independent rows is close to 0.8.
    logits = torch.tensor([[0.0, float(torch.log(torch.tensor(0.25))), -1e9, -1e9]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    out = sample(logits, SamplingBatch(params, [[]] * 4000, [[]] * 4000))
    share = out.token_ids.count(0) / 4000
    assert 0.77 < share < 0.83


def test_top_k_top_p_keep_exact_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    top_k = sample(logits, SamplingBatch([SamplingParams(top_k=2)] * 2000, [[]] * 2000, [[]] * 2000))
    assert set(top_k.token_ids) == {0, 1}
    # top_p=0.8: the smallest prefix with mass >= 0.8 is {0, 1}.
    top_p = sample(logits, SamplingBatch([SamplingParams(top_p=0.8)] * 2000, [[]] * 2000, [[]] * 2000))
    assert set(top_p.token_ids) == {0, 1}


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    prompts = [[1, 2, 3], [4, 5], [6]]
    outputs = [[7, 8], [9], []]
    params = [SamplingParams(temperature=0, repetition_penalty=r) for r in (1.3, 2.0, 1.0)]
    got = sample(logits, SamplingBatch(params, prompts, outputs)).token_ids
    for row in range(3):
        seen = torch.tensor([prompts[row] + outputs[row] or [0]])
        proc = RepetitionPenaltyLogitsProcessor(params[row].repetition_penalty)
        ref = proc(seen, logits[row : row + 1].clone()) if prompts[row] + outputs[row] else logits[row : row + 1]
        assert got[row] == int(ref.argmax())


def test_presence_and_frequency_penalties_hand_computed():
    # Token 0 has the best logit but appeared twice in the output: 3.0 - 2*0.8 - 0.5 = 0.9
    # is below token 1's 1.0.
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.8)
    assert sample(logits, SamplingBatch([p], [[]], [[0, 0]])).token_ids == [1]
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.7)
    assert sample(logits, SamplingBatch([p], [[]], [[0, 0]])).token_ids == [0]  # 1.1 > 1.0


def test_min_tokens_blocks_eos():
    logits = torch.tensor([[5.0, 1.0, 0.0]])  # EOS (id 0 here) is the best token
    p = SamplingParams(temperature=0, min_tokens=2)
    assert sample(logits, SamplingBatch([p], [[]], [[4]], frozenset({0}))).token_ids == [1]
    assert sample(logits, SamplingBatch([p], [[]], [[4, 4]], frozenset({0}))).token_ids == [0]


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 20
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    stopped = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                           stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == greedy.token_ids[: first + 1]


def _finish_after(tokens, eos, **kw):
    from travelator.engine.request import Request, stop_by_token

    params = SamplingParams(**kw)
    req = Request("r", [1], params, params.max_tokens or 100, eos_token_ids=frozenset(eos))
    for n, t in enumerate(tokens, 1):
        if (stop := stop_by_token(req, t, n)) is not None:
            return n, stop.status.finish_reason
    return None, None


def test_eos_ends_unless_ignored_or_before_min_tokens():
    assert _finish_after([5, 6, 2, 7], eos={2}) == (3, "stop")
    assert _finish_after([5, 6, 2, 7], eos={2}, ignore_eos=True, max_tokens=4) == (4, "length")
    assert _finish_after([2, 6, 2, 7], eos={2}, min_tokens=2) == (3, "stop")
    assert _finish_after([5, 6, 9], eos={2}, stop_token_ids=[6]) == (2, "stop")


@pytest.mark.skipif(not __import__("travelator.kernels", fromlist=["available"]).available(),
                    reason="needs the native kernels")
def test_native_race_follows_the_distribution_and_the_seed():
    """The native exponential race: shares of 20,000 draws (distinct seeds) match the
    softmax within sampling error; filtered (-inf) tokens never come; a seed gives the same
    token whatever the other rows are."""
    race = torch.ops.travelator.exponential_race
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    scores = p.log().repeat(20000, 1).contiguous()
    ids = race(scores, torch.arange(20000, dtype=torch.long) * 7919 + 3)
    shares = torch.bincount(ids, minlength=5).double() / 20000
    assert torch.all((shares - p.double()).abs() < 4 * (p.double() * (1 - p.double()) / 20000).sqrt() + 1e-9)
    assert shares[4] == 0
    mixed = torch.cat([torch.randn(3, 5), scores[:1]]).contiguous()
    again = race(mixed, torch.tensor([1, 2, 3, 3], dtype=torch.long))
    assert again[3] == race(scores[:1].contiguous(), torch.tensor([3], dtype=torch.long))[0]



@pytest.mark.skipif(not __import__("travelator.kernels", fromlist=["available"]).available(),
                    reason="needs the native kernels")
def test_native_race_never_draws_a_uniform_of_one():
    """Seed 3 hashes vocabulary index 528417 to the top 24-bit value (splitmix64, as
    csrc/sampling.cpp keys it), whose uniform rounds to 1.0 in float32: its noise would be
    infinite and the token would win at probability e^-50. It must not."""
    scores = torch.full((1, 528418), float("-inf"))
    scores[0, 0] = 0.0
    scores[0, 528417] = -50.0
    assert torch.ops.travelator.exponential_race(scores, torch.tensor([3], dtype=torch.long)).item() == 0

def _nucleus_by_full_sort(logits, top_k, top_p):
    """The definition, by a full sort: each row's top_k, then the smallest prefix whose
    probability over them reaches top_p."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        vals, order = logits[r].sort(descending=True)
        k = min(top_k[r], logits.shape[1]) if top_k[r] > 0 else logits.shape[1]
        probs = torch.softmax(vals[:k].double(), dim=0)
        n = int((probs.cumsum(0) - probs < top_p[r]).sum())
        kept[r, order[:max(n, 1)]] = True
    return kept


@pytest.mark.parametrize("sharpness", [0.1, 3.0, 12.0])  # flat (full-sort fallback) to peaked
def test_top_k_top_p_fast_path_is_exact(sharpness):
    from travelator.model.sampler import _apply_top_k_top_p_min_p

    g = torch.Generator().manual_seed(int(sharpness * 10))
    logits = torch.randn(12, 5000, generator=g) * sharpness
    top_k = [0, 5, 300, 0, 0, 1, 40, 0, 4999, 0, 0, 7]
    top_p = [0.9, 1.0, 0.5, 0.99, 1.0, 1.0, 0.3, 0.7, 0.95, 0.2, 1e-6, 0.8]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(top_k, top_p)]
    got = _apply_top_k_top_p_min_p(logits.clone(), params)
    kept = torch.isfinite(got)
    assert torch.equal(kept, _nucleus_by_full_sort(logits, top_k, top_p))
    assert torch.equal(got[kept], logits[kept])  # kept logits are untouched
