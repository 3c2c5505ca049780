"""The Triton exponential race (kernels/triton_sampling.py): draws from softmax(scores), a
row's draw fixed by its seed and scores alone, whatever the batch, the row's position or the
tile width. Without a GPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, which
conftest.py sets), on the CPU, where each program costs milliseconds: the batches are small.

Every seed here is fixed, so each test is deterministic: a statistical bound cannot flake, it
either holds for these draws or never does."""

from __future__ import annotations

import pytest
import torch

from travelator.kernels import triton_sampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def race(scores, seeds, **kw):
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    return triton_sampling.exponential_race(scores.to(DEVICE).contiguous(), seeds.to(DEVICE), **kw).cpu()


# The 99.9% quantile of the chi-square distribution with 5 degrees of freedom: a correct
# sampler exceeds it for one draw of seeds in a thousand.
_CHI2_5_999 = 20.52


def test_draws_follow_the_softmax():
    """One row of 1000 scores drawn with 400 seeds: five heavy tokens spread over the row and
    the rest of the vocabulary as a sixth bin, against their probabilities by chi-square;
    filtered (-inf) tokens never come."""
    vocab, draws = 1000, 400
    heavy = torch.tensor([0, 333, 500, 871, 999])
    probs = torch.full((vocab,), 0.2 / (vocab - 5 - 10))
    probs[heavy] = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05])
    filtered = torch.arange(100, 1000, 90)  # ten tokens, none heavy
    probs[filtered] = 0.0
    scores = probs.log().unsqueeze(0).repeat(draws, 1)
    ids = race(scores, torch.arange(draws) * 0x9E3779B1 + 17)
    assert not torch.isin(ids, filtered).any()
    counts = torch.bincount(ids, minlength=vocab).double()
    observed = torch.cat([counts[heavy], (draws - counts[heavy].sum()).unsqueeze(0)])
    expected = draws * torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05, 0.2], dtype=torch.float64)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < _CHI2_5_999, (observed.tolist(), expected.tolist(), chi2)


def test_a_row_draws_the_same_alone_and_anywhere_in_a_batch():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 2000, generator=g) * 2
    alone = int(race(row, [1234])[0])
    others = torch.randn(5, 2000, generator=g) * 2
    batch = torch.cat([others[:2], row, others[2:4], row, others[4:]])
    got = race(batch, [7, 8, 1234, 9, 10, 1234, 11])
    assert got[2] == alone and got[5] == alone
    # The other rows do not change the draw either: the same row, new neighbours.
    assert race(torch.cat([row, others[:1] * 0]), [1234, 1234])[0] == alone


def test_the_tile_width_and_the_split_do_not_change_the_draw():
    """Noise is keyed by the vocabulary index, not the tile or the program: narrow tiles (the
    last one partial), one program per row walking them all or several per row, all merge to
    the same token as one wide tile."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 3000, generator=g)
    scores[1, :2000] = float("-inf")  # a split with nothing left in it
    seeds = [3, 1 << 40, 77, 2**63 - 1, 0, 123456789]
    want = race(scores, seeds, splits=1)
    for splits in (1, 5, None):  # None: as many as tiles here
        assert torch.equal(race(scores, seeds, block=128, splits=splits), want), splits


def test_different_seeds_give_different_draws_and_the_same_seed_the_same():
    flat = torch.zeros(16, 1000)
    seeds = torch.arange(16) * 1000003 + 5
    first = race(flat, seeds)
    assert len(set(first.tolist())) >= 14  # uniform over 1000: collisions are rare
    assert torch.equal(race(flat, seeds), first)


def test_the_whole_64_bit_seed_keys_the_noise():
    """Seeds differing only above bit 31 draw differently: no half of the seed is dropped."""
    flat = torch.zeros(4, 1000)
    low = 5
    ids = race(flat, [low, low + (1 << 32), low + (1 << 45), low + (1 << 62)])
    assert len(set(ids.tolist())) == 4


@pytest.mark.parametrize("block", [256, triton_sampling.BLOCK])
def test_a_dominant_score_wins_and_filtered_tokens_never_do(block):
    vocab = 1500
    scores = torch.zeros(5, vocab)
    for row, j in enumerate([0, 700, vocab - 1]):
        scores[row, j] = 1e4
    scores[3] = float("-inf")
    scores[3, 1234] = -50.0  # the only token left
    scores[4] = float("nan")
    scores[4, :600] = float("-inf")
    scores[4, 999] = 0.0  # NaN and -inf are filtered: this is the only candidate
    assert race(scores, [1, 2, 3, 4, 5], block=block).tolist() == [0, 700, vocab - 1, 1234, 999]
    nothing = torch.full((2, vocab), float("-inf"))
    assert race(nothing, [1, 2], block=block).tolist() == [0, 0]  # as the CPU kernel


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        race(torch.zeros(2, 10, dtype=torch.float64), [1, 2])
    with pytest.raises(ValueError, match="seeds"):
        triton_sampling.exponential_race(torch.zeros(2, 10, device=DEVICE), torch.zeros(3, dtype=torch.long,
                                                                                       device=DEVICE))


def test_an_engine_on_the_triton_path_samples_the_same_alone_and_batched(monkeypatch):
    """The whole engine with kernels="triton" (the race under the interpreter here): a seeded
    request gets the same tokens alone and beside other requests, seeded and not, with
    filters and penalties in the batch; another seed gets other tokens."""
    from travelator import LLM, SamplingParams

    calls = []

    def counted(scores, seeds):
        calls.append(scores.shape[0])
        return kernel(scores, seeds)

    kernel = triton_sampling.exponential_race
    monkeypatch.setattr(triton_sampling, "exponential_race", counted)
    llm = LLM("dummy:tiny", device=DEVICE, kernels="triton", dtype="float32", max_num_seqs=4, block_size=8)
    prompt = list(range(10, 22))
    mine = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=4321, ignore_eos=True)
    alone = llm.generate([prompt], mine, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, top_k=20, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, repetition_penalty=1.3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    batch = llm.generate([list(range(300, 305)), list(range(40, 70)), prompt, [7, 8, 9]],
                         [others[0], others[1], mine, others[2]], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert calls and max(calls) > 1  # the kernel drew, batched rows included
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=4322, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
