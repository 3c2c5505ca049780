"""/v1/embeddings, /v1/score and /v1/rerank on a live server, through the openai SDK,
LangChain's OpenAIEmbeddings and plain HTTP, against transformers' hidden states and logits
of the same random-init checkpoint."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
import torch

from hf_models import build_checkpoint, load_reference, randomize
from live import serve_in_thread
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.scoring import ScoreFormat
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

TEMPLATE = "Query: {query} Doc: {document} Answer:"
TEXTS = ["a short text", "another text, somewhat longer than the first one was", "z"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("embed"), "llama")
    randomize(path, ("norm.weight",), scale=0.5, offset=1.0)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=32, block_size=4)
    settings = ServerSettings(served_model_names=["m"], max_embedding_inputs=8,
                              score_format=ScoreFormat(TEMPLATE, ("a", "b")))
    with serve_in_thread(build_app(AsyncEngine(llm.engine), settings)) as url:
        yield url, llm.get_tokenizer()


@torch.inference_mode()
def _want_embedding(reference, ids: list[int], pooling: str = "last") -> list[float]:
    hidden = reference.model(torch.tensor([ids])).last_hidden_state[0].double()
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0).tolist()


@torch.inference_mode()
def _want_score(reference, tokenizer, query: str, document: str) -> float:
    ids = tokenizer.encode(TEMPLATE.replace("{query}", query).replace("{document}", document))
    logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
    a, b = (logprobs[tokenizer.encode(label, add_special_tokens=False)[0]].item() for label in "ab")
    return math.exp(a) / (math.exp(a) + math.exp(b))


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=2e-5, rtol=0)


def test_openai_sdk_embeddings_base64_and_float(server, reference):
    url, tokenizer = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    for fmt in (openai.NOT_GIVEN, "float"):  # the SDK asks for base64 unless told otherwise
        got = client.embeddings.create(model="m", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in got.data] == [0, 1, 2]
        ids = [tokenizer.encode(t) for t in TEXTS]
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
        for d, prompt in zip(got.data, ids):
            _close(d.embedding, _want_embedding(reference, prompt))
    tokens = client.embeddings.create(model="m", input=[[1, 40, 41, 42]], encoding_format="float")
    _close(tokens.data[0].embedding, _want_embedding(reference, [1, 40, 41, 42]))


def test_langchain_openai_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    url, tokenizer = server
    # check_embedding_ctx_length=False: send text, not tiktoken's token ids (which are OpenAI's).
    emb = OpenAIEmbeddings(model="m", base_url=f"{url}/v1", api_key="x", check_embedding_ctx_length=False)
    for got, text in zip(emb.embed_documents(TEXTS), TEXTS):
        _close(got, _want_embedding(reference, tokenizer.encode(text)))
    _close(emb.embed_query("what is it"), _want_embedding(reference, tokenizer.encode("what is it")))


def test_rerank_and_score(server, reference):
    url, tokenizer = server
    want = [_want_score(reference, tokenizer, "what is it", d) for d in TEXTS]
    with httpx.Client(base_url=url, timeout=60) as http:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            body = http.post(path, json={"model": "m", "query": "what is it", "top_n": 2,
                                         "documents": [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]]}).json()
            best = sorted(range(3), key=lambda i: -want[i])[:2]
            assert [r["index"] for r in body["results"]] == best
            for r in body["results"]:
                assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
                assert r["document"]["text"] == TEXTS[r["index"]]
        one_to_many = http.post("/v1/score", json={"text_1": "what is it", "text_2": TEXTS}).json()
        assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want, abs=1e-5)
        pairs = http.post("/v1/score", json={"text_1": ["q one", "q two"], "text_2": TEXTS[:2]}).json()
        assert [d["score"] for d in pairs["data"]] == pytest.approx(
            [_want_score(reference, tokenizer, q, d) for q, d in zip(["q one", "q two"], TEXTS[:2])], abs=1e-5)


def test_embeddings_beside_streamed_generation(server, reference):
    """Embeddings run while a generation streams: both answers are right."""
    url, tokenizer = server

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x")
        gen = client.completions.create(model="m", prompt="hello there", max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        embeds = [client.embeddings.create(model="m", input=[t] * 4, encoding_format="float") for t in TEXTS]
        return await asyncio.gather(gen, *embeds)

    completion, *embeds = asyncio.run(main())
    assert completion.usage.completion_tokens == 40
    for got, text in zip(embeds, TEXTS):
        for d in got.data:
            _close(d.embedding, _want_embedding(reference, tokenizer.encode(text)))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input"),
    ("/v1/embeddings", {"input": [[1, 2, 10**6]]}, "input"),
    ("/v1/embeddings", {"input": "x" * 600}, "input"),  # past the context length
    ("/v1/embeddings", {"input": ["a"] * 9}, "input"),  # past max_embedding_inputs
    ("/v1/embeddings", {"input": "a", "dimensions": 7}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": "a", "priority": 10**6}, "priority"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": [], "text_2": ["c"]}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents"),
])
def test_bad_inputs_are_400s_naming_the_field(server, path, body, param):
    url, _ = server
    response = httpx.post(url + path, json={"model": "m", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0].split("[")[0] == param, error
