"""Prompt-only requests: embeddings and scores, against transformers' hidden states and logits
of the same random-init checkpoints, computed in chunks, beside generation in the same
batches, with and without the prefix cache."""

from __future__ import annotations

import math

import pytest
import torch

from hf_models import build_checkpoint, load_reference, randomize
from travelator import LLM, SamplingParams
from travelator.errors import InvalidRequestError
from travelator.pooling_params import PoolingParams
from travelator.scoring import ScoreFormat, relevance

PROMPTS = [[1, 5, 9, 33], list(range(3, 40)), [1] + [7 + (i * 13) % 250 for i in range(70)]]


@pytest.fixture(scope="module", params=["llama"])
def checkpoint(request, tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    # The final norm's weight is 1 when transformers initialises it: a pooler reading the
    # hidden states before the norm would pass unnoticed.
    randomize(path, ("norm.weight",), scale=0.5, offset=1.0)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # Chunks of 16 tokens: the longer prompts are pooled over several steps.
    return LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=16, max_num_seqs=8,
               block_size=4, enable_prefix_caching=True)


@torch.inference_mode()
def _hidden(reference, tokens: list[int]) -> torch.Tensor:
    return reference.model(torch.tensor([tokens])).last_hidden_state[0].double()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_final_hidden_states(llm, reference, pooling):
    got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], pooling=pooling, use_tqdm=False)
    for prompt, vector in zip(PROMPTS, got):
        hidden = _hidden(reference, prompt)
        want = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
        assert len(vector) == hidden.shape[1]
        torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64), want, atol=2e-5, rtol=0)


def test_unnormalized_and_cut_embeddings(llm, reference):
    prompt = PROMPTS[1]
    full = llm.embed([{"prompt_token_ids": prompt}], normalize=False, use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(full, dtype=torch.float64), _hidden(reference, prompt)[-1],
                               atol=1e-4, rtol=1e-5)
    cut = llm.embed([{"prompt_token_ids": prompt}], dimensions=8, use_tqdm=False)[0]
    want = torch.nn.functional.normalize(torch.tensor(full[:8], dtype=torch.float64), dim=0)
    torch.testing.assert_close(torch.tensor(cut, dtype=torch.float64), want, atol=1e-6, rtol=0)


def test_embeddings_beside_generation_in_one_batch(llm, reference):
    """Prompt-only requests share steps with decodes: neither changes the other."""
    gen = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], gen, use_tqdm=False)[0].token_ids
    mean = SamplingParams(max_tokens=0, pooling=PoolingParams("embed", "mean"))
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}] + [{"prompt_token_ids": p} for p in PROMPTS[1:]],
                         [gen, mean, mean], use_tqdm=False)
    assert mixed[0].token_ids == alone
    assert mixed[1].token_ids == [] and mixed[1].outputs[0].finish_reason == "length"
    for result, prompt in zip(mixed[1:], PROMPTS[1:]):
        want = torch.nn.functional.normalize(_hidden(reference, prompt).mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(result.pooled, dtype=torch.float64), want, atol=2e-5, rtol=0)


def test_mean_never_takes_the_prefix_cache_and_last_does(llm, reference):
    shared = PROMPTS[2][:40]
    llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=1), use_tqdm=False)
    prompt = shared + [11, 12, 13, 14, 15]
    hidden = _hidden(reference, prompt)
    stats = llm.engine.kv.stats
    for how, want, hit in (("mean", hidden.mean(0), False), ("last", hidden[-1], True)):
        before = stats.hit_tokens
        got = llm.embed([{"prompt_token_ids": prompt}], pooling=how, use_tqdm=False)[0]
        assert (stats.hit_tokens > before) == hit, how
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.nn.functional.normalize(want, dim=0), atol=2e-5, rtol=0)


@torch.inference_mode()
def test_scores_are_the_label_tokens_share(llm, reference, checkpoint):
    fmt = ScoreFormat(template="Query: {query} Doc: {document} Answer:", labels=("a", "b"))
    documents = ["first document", "another, longer document about something else", "x"]
    got = llm.score("what is it", documents, score_format=fmt, use_tqdm=False)
    tok = llm.get_tokenizer()
    labels = [tok.encode(label, add_special_tokens=False)[0] for label in ("a", "b")]
    for document, score in zip(documents, got):
        ids = tok.encode(f"Query: what is it Doc: {document} Answer:")
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        a, b = logprobs[labels].tolist()
        assert score == pytest.approx(math.exp(a) / (math.exp(a) + math.exp(b)), abs=1e-5)


def test_relevance_and_bad_parameters():
    assert relevance([math.log(0.3), math.log(0.1)]) == pytest.approx(0.75)
    assert relevance([math.log(0.4)]) == pytest.approx(0.4)
    assert relevance([-math.inf, 0.0]) == 0.0
    with pytest.raises(InvalidRequestError, match="pooling"):
        PoolingParams("embed", "max")
    with pytest.raises(InvalidRequestError, match="label"):
        PoolingParams("score")
    with pytest.raises(InvalidRequestError, match="max_tokens=0"):
        SamplingParams(max_tokens=4, pooling=PoolingParams())
    with pytest.raises(ValueError, match="one token"):
        ScoreFormat(labels=("yes",)).label_token_ids(_ByteTokenizer())


class _ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())
