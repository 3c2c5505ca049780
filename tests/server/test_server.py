"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client and httpx.

One uvicorn server (in a thread) serves the whole module; stories260K in float32.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paths import STORIES, needs_stories
from live import serve_in_thread
from travelator import LLM, SamplingParams
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

pytestmark = needs_stories

API_KEY = "test-key"
MODEL = "stories"
PROMPT = "Once upon a time"
BODY_LIMIT = 64 * 1024


# ---------------------------------------------------------------------------- helpers


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics as ``name{label=value,...}`` -> value (model_name left out)."""
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(base_url: str, baseline_blocks: float, timeout: float) -> float:
    """Seconds until no request is in flight and the KV blocks in use are back to the baseline."""
    t0 = time.monotonic()
    while True:
        m = scrape(base_url)
        if m["travelator_num_requests_in_flight"] == 0 and m["travelator_kv_cache_used_blocks"] == baseline_blocks:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not idle after {timeout} s: {m}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=1024)
    async_engine = AsyncEngine(llm.engine)
    settings = ServerSettings(served_model_names=[MODEL], api_key=API_KEY, max_body_bytes=BODY_LIMIT)
    app = build_app(async_engine, settings)
    with serve_in_thread(app, log_level="warning") as url:
        yield SimpleNamespace(url=url, engine=llm.engine, async_engine=async_engine,
                              tokenizer=llm.engine.tokenizer)
    assert not async_engine.healthy  # the lifespan stopped the step loop


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The offline API on its own engine: the reference for greedy outputs."""
    return LLM(str(STORIES), dtype="float32", num_kv_blocks=256)


def still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ", there was a little"


# ---------------------------------------------------------------------------- basics


def test_models_health_and_greedy_text(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").json() == {"status": "ok"}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, user="tester",
                                    extra_body={"priority": 1})
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert (PROMPT + out.choices[0].text).startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside")
    assert out.choices[0].finish_reason == "length"


def test_completions_sync_stream_equals_nonstream(server, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    text = full.choices[0].text
    n_prompt = len(server.tokenizer.encode(PROMPT))
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 32
    assert full.usage.total_tokens == n_prompt + 32
    assert full.usage.prompt_tokens_details is not None

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.prompt_tokens == n_prompt

    # Another seed samples another text (a sanity check that the seed is used at all).
    other = client.completions.create(**{**kw, "seed": 99})
    assert other.choices[0].text != text


def test_chat_sync_stream_equals_nonstream(server, client):
    messages = [{"role": "system", "content": "You tell stories."},
                {"role": "user", "content": "Tell me about a cat."}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=24, temperature=1.0, seed=7)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    rendered = server.tokenizer.apply_chat_template(messages)
    n_prompt = len(server.tokenizer.encode(rendered, add_special_tokens=False))
    assert full.usage.prompt_tokens == n_prompt
    assert 0 < full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert not any(c.choices[0].finish_reason for c in with_choices[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_async_client_both_endpoints(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        kw = dict(model=MODEL, prompt="Lily and Ben", max_tokens=20, temperature=1.0, seed=5)
        full = await aclient.completions.create(**kw)
        stream = await aclient.completions.create(stream=True, **kw)
        parts = [c.choices[0].text async for c in stream]
        assert "".join(parts) == full.choices[0].text

        ckw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                   temperature=1.0, seed=5)
        cfull = await aclient.chat.completions.create(**ckw)
        cstream = await aclient.chat.completions.create(stream=True, **ckw)
        cparts = [c.choices[0].delta.content or "" async for c in cstream if c.choices]
        assert "".join(cparts) == cfull.choices[0].message.content
        await aclient.close()

    asyncio.run(main())


def test_n_choices_and_prompt_batches(server, client):
    out = client.completions.create(model=MODEL, prompt=["Once upon a time", "Sam wanted to"], n=2,
                                    max_tokens=12, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 4 * 12
    tok = server.tokenizer
    assert out.usage.prompt_tokens == len(tok.encode("Once upon a time")) + len(tok.encode("Sam wanted to"))
    # Choice j of a prompt is seeded with seed + j, like the offline API: choice 1 with seed 3
    # is choice 0 with seed 4.
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                      temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[1].text
    # Token-id prompts work and count exactly.
    ids = tok.encode("Once upon a time")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == ", there was a little"
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_strings(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[" Lily"])
    c = out.choices[0]
    assert c.text == ", there was a little girl named"
    assert c.finish_reason == "stop"
    assert c.model_extra.get("stop_reason") == " Lily"


def test_completion_logprobs_and_echo(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
                                    echo=True)
    c = out.choices[0]
    assert c.text.startswith(PROMPT + ", there was")
    lp = c.logprobs
    n_prompt = len(server.tokenizer.encode(PROMPT))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 10
    assert "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:n_prompt])  # prompt scored
    assert all(x <= 0 for x in lp.token_logprobs[n_prompt:])
    for tok, top, logprob in zip(lp.tokens[n_prompt:], lp.top_logprobs[n_prompt:], lp.token_logprobs[n_prompt:]):
        assert 1 <= len(top) <= 3 and top[tok] == logprob  # greedy: the sampled token is the best
        assert max(top.values()) == logprob
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(offsets[i + 1] - offsets[i] == len(lp.tokens[i]) for i in range(len(offsets) - 1))

    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                              logprobs=1, stream=True))
    tokens = [t for ch in streamed for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    assert len(tokens) == 10 and "".join(tokens) == "".join(ch.choices[0].text for ch in streamed)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    c = out.choices[0]
    content = c.logprobs.content
    assert len(content) == 8
    assert "".join(e.token for e in content) == c.message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == e.logprob  # greedy
        assert bytes(e.bytes).decode() == e.token


# ---------------------------------------------------------------------------- concurrency


NAMES = ["Lily", "Ben", "Tom", "Sue"]
ACTIONS = ["went to the park", "saw a dog", "had a red ball", "was sad", "found a box",
           "liked to sing", "wanted a cake", "met a bird"]


def test_32_concurrent_streams_match_offline(server, offline):
    prompts = [f"{name} {action}" for name in NAMES for action in ACTIONS]
    max_tokens = [4 + (i * 7) % 29 for i in range(len(prompts))]  # 4..32, all different lengths
    expected = [
        offline.generate(p, SamplingParams(temperature=0, max_tokens=m), use_tqdm=False)[0].text
        for p, m in zip(prompts, max_tokens)  # each alone
    ]
    before = scrape(server.url)

    async def one(aclient, prompt, m):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0,
                                                  stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    for prompt, want, (got, finish) in zip(prompts, expected, results):
        assert got == want, prompt
        assert finish in ("stop", "length")
    after = scrape(server.url)
    finished = sum(after[f"travelator_request_success_total{{finished_reason={r}}}"]
                   - before[f"travelator_request_success_total{{finished_reason={r}}}"] for r in ("stop", "length"))
    assert finished == 32
    # They shared steps: some step ran more than one request.
    assert after["travelator_batch_size_bucket{le=1.0}"] - before["travelator_batch_size_bucket{le=1.0}"] < (
        after["travelator_batch_size_count"] - before["travelator_batch_size_count"])


# ---------------------------------------------------------------------------- disconnects


def _long_request(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, **extra}


def test_streaming_client_disconnect_aborts(server, http):
    base = scrape(server.url)
    with http.stream("POST", "/v1/completions", json=_long_request(stream=True)) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
    # Leaving the block closes the half-read response, hence the connection.
    waited = wait_idle(server.url, base["travelator_kv_cache_used_blocks"], timeout=5)
    assert waited < 1.0
    after = scrape(server.url)
    generated = after["travelator_generation_tokens_total"] - base["travelator_generation_tokens_total"]
    assert 3 <= generated < 1000, generated
    assert after["travelator_request_success_total{finished_reason=abort}"] == (
        base["travelator_request_success_total{finished_reason=abort}"] + 1)
    time.sleep(0.2)
    assert scrape(server.url)["travelator_generation_tokens_total"] == after["travelator_generation_tokens_total"]
    server.engine.kv.check_consistency()
    still_serves(http)


def test_nonstreaming_client_disconnect_aborts(server, http):
    base = scrape(server.url)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", timeout=httpx.Timeout(10, read=0.3), json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True})
    waited = wait_idle(server.url, base["travelator_kv_cache_used_blocks"], timeout=5)
    assert waited < 1.0
    after = scrape(server.url)
    generated = after["travelator_generation_tokens_total"] - base["travelator_generation_tokens_total"]
    assert generated < 2000, generated  # and the abort counter below says it was cut short
    assert after["travelator_request_success_total{finished_reason=abort}"] == (
        base["travelator_request_success_total{finished_reason=abort}"] + 1)
    still_serves(http)


# ---------------------------------------------------------------------------- bad input


def _post(http, path, body, headers=None):
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    return http.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})


BAD_REQUESTS = [
    # (name, path, body, headers, status, param, code)
    ("malformed json", "/v1/completions", b'{"model": "stories", "prompt": ', None, 400, None, "invalid_json"),
    ("empty body", "/v1/completions", b"", None, 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", None, 400, None, None),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, None, 400,
     "max_tokens", None),
    ("prompt type", "/v1/completions", {"model": MODEL, "prompt": 5}, None, 400, "prompt", None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt", None),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, None, 400, "prompt", None),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": -5}, None, 400,
     "max_tokens", None),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": -1}, None, 400,
     "temperature", None),
    ("bad token id", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, None, 400, "prompt", None),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": PROMPT}, None, 404, "model",
     "model_not_found"),
    ("huge n", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 10000}, None, 400, "n", None),
    ("over-long prompt", "/v1/completions", {"model": MODEL, "prompt": [1] + [300] * 2999}, None, 400, "prompt",
     "context_length_exceeded"),
    ("max_tokens past context", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5000}, None,
     400, "max_tokens", "context_length_exceeded"),
    ("body too large", "/v1/completions", {"model": MODEL, "prompt": "a" * (BODY_LIMIT + 10)}, None, 413, None,
     "request_too_large"),
    ("missing api key", "/v1/completions", {"model": MODEL, "prompt": PROMPT}, {"Authorization": ""}, 401, None,
     "invalid_api_key"),
    ("wrong api key", "/v1/completions", {"model": MODEL, "prompt": PROMPT}, {"Authorization": "Bearer nope"}, 401,
     None, "invalid_api_key"),
    ("chat no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", None),
    ("chat bad message", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, None, 400,
     "messages.0.role", None),
    ("string max_tokens", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "5"}, None, 400,
     "max_tokens", None),
    ("decimal max_tokens", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5.0}, None, 400,
     "max_tokens", None),
    ("string stream", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": "yes"}, None, 400,
     "stream", None),
    ("chat unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     None, 400, "messages.0.role", None),
    ("chat null user content", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": None}]}, None, 400, "messages.0.content", None),
    ("chat unknown model", "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "x"}]},
     None, 404, "model", "model_not_found"),
    ("chat over-long", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time " * 600}]}, None, 400,
     "messages", "context_length_exceeded"),
    ("no such route", "/v1/images/generations", {"model": MODEL, "prompt": "x"}, None, 404, None, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_json_error(server, http, name, path, body, headers, status, param, code):
    r = _post(http, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if name == "over-long prompt":
        assert "3000" in err["message"] and "2048" in err["message"]
    if name == "max_tokens past context":
        assert "5000" in err["message"] and "2048" in err["message"]
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    still_serves(http)


def test_openai_client_errors(server):
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key


# ---------------------------------------------------------------------------- metrics


def test_metrics_parse_and_move(server, client):
    before = scrape(server.url)
    for name in ("travelator_num_requests_running", "travelator_num_requests_waiting",
                 "travelator_kv_cache_usage", "travelator_num_preemptions_total",
                 "travelator_time_per_output_token_seconds_count", "travelator_e2e_request_latency_seconds_count"):
        assert name in before
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def delta(name):
        return after[name] - before[name]

    assert delta("travelator_generation_tokens_total") == 7
    assert delta("travelator_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("travelator_request_success_total{finished_reason=length}") == 1
    assert delta("travelator_time_to_first_token_seconds_count") == 1
    assert delta("travelator_time_per_output_token_seconds_count") == 1
    assert delta("travelator_e2e_request_latency_seconds_count") == 1
    assert delta("travelator_e2e_request_latency_seconds_sum") > 0
    assert delta("travelator_batch_size_count") >= 7
    assert after["travelator_num_requests_running"] == 0
    assert after["travelator_kv_cache_usage"] == 0


# ---------------------------------------------------------------------------- without a running engine


def test_health_and_requests_when_the_engine_is_dead(offline):
    from fastapi.testclient import TestClient

    # An AsyncEngine whose loop never started reads as dead; no lifespan runs without `with`.
    app = build_app(AsyncEngine(offline.engine), ServerSettings(served_model_names=[MODEL]))
    c = TestClient(app)
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    assert c.get("/v1/models").status_code == 200


# ---------------------------------------------------------------------------- what real clients need


def test_tokenize_detokenize_and_version(server, http):
    # The ids the model's README gives for this prompt (checked there against llama.cpp).
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 5, "max_model_len": server.engine.max_model_len,
                        "tokens": [1, 403, 407, 261, 378], "token_strs": None}
    r = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == [403, 407, 261, 378]
    assert r.json()["token_strs"] == ["▁Once", "▁upon", "▁a", "▁time"]
    assert http.post("/detokenize", json={"tokens": [403, 407, 261, 378]}).json() == {"prompt": PROMPT}
    # A chat body counts what /v1/chat/completions feeds the engine.
    messages = [{"role": "user", "content": "Tell me a story"}]
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert r.json()["tokens"] == server.tokenizer.encode_chat(messages)
    # Bad input: the OpenAI error shape, with the parameter named.
    r = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = http.post("/tokenize", json={"prompt": PROMPT, "model": "nope"})
    assert r.status_code == 404
    assert http.post("/tokenize", json={"text": PROMPT}).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).status_code == 401  # no key
    r = http.get("/version")
    assert r.status_code == 200 and r.json()["version"] == "0.1.0"


def test_cors_only_when_origins_are_given(offline):
    from fastapi.testclient import TestClient

    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = TestClient(build_app(AsyncEngine(offline.engine), ServerSettings(served_model_names=[MODEL])))
    r = closed.options("/v1/completions", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    opened = TestClient(build_app(AsyncEngine(offline.engine), ServerSettings(
        served_model_names=[MODEL], api_key=API_KEY, allowed_origins=["https://ui.example"])))
    r = opened.options("/v1/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = opened.get("/v1/models", headers={"Origin": "https://ui.example", "Authorization": f"Bearer {API_KEY}"})
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    r = opened.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_the_waiting_queue_is_unbounded_unless_set():
    assert ServerSettings().max_waiting is None
    ServerSettings(max_waiting=None).validate()
    with pytest.raises(ValueError, match="max_waiting"):
        ServerSettings(max_waiting=0).validate()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_send_one_chunk_per_token(server, http, path):
    """Clients that count chunks as tokens (guidellm, aiperf) need a chunk for every token,
    even one whose text the detokenizer holds back (a newline here, or a partial character)."""
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    token_chunks, usage, text = 0, None, ""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                if "text" in choice:  # completions: every chunk carries a token step
                    piece = choice["text"]
                else:  # chat: not the role chunk, not the finish chunk (an empty delta)
                    delta = choice["delta"]
                    piece = delta.get("content") if "role" not in delta else None
                if piece is not None:
                    token_chunks += 1
                    text += piece
    assert usage["completion_tokens"] == 64
    assert token_chunks == 64
    assert "\n" in text  # the case that used to lose a chunk


def test_accepted_forms_stay_accepted(http):
    """Strict types still take what OpenAI takes: an integer for a float, an assistant turn
    with null content, more than OpenAI's 4 stop strings (an extension, as vLLM)."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                           "top_p": 1, "stop": ["a", "b", "c", "d", "e", "f"]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None}, {"role": "developer", "content": [{"type": "text", "text": "Go"}]}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(server, http, offline, max_tokens, stream):
    """What lm-evaluation-harness's loglikelihood sends: echo, logprobs 1, max_tokens 0 or 1.
    The prompt's token logprobs equal the offline engine's prompt logprobs; the first is null."""
    text = "Once upon a time there was a little dog"
    ids = offline.engine.tokenizer.encode(text)
    ref = offline.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    body = {"model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp, full_text = choice["logprobs"], choice["text"]
    else:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        full_text = ""
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    full_text += c["text"]
                    for k in lp:
                        lp[k] += c["logprobs"][k]
    assert full_text.startswith(text)
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for k in range(1, len(ids)):
        assert lp["token_logprobs"][k] == pytest.approx(ref.prompt_logprobs[k].logprob, abs=1e-5)
        # the harness's greedy check: is the token the top alternative?
        assert max(lp["top_logprobs"][k].values()) >= lp["token_logprobs"][k]
    assert "".join(lp["tokens"][:len(ids)]) == offline.engine.tokenizer.decode(ids)


def test_responses_api_with_the_openai_sdk(server, client):
    """The Responses API's text core, through the official SDK: the same text as a chat
    completion of the same messages, usage, the incomplete status at max_output_tokens, and
    the streamed events."""
    resp = client.responses.create(model=MODEL, input="Tell me a story", instructions="Be kind.",
                                   max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story"}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 12
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, stream=True, input=[
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}]))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 12 and "".join(deltas) == resp.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == resp.output_text
    with pytest.raises(openai.NotFoundError) as err:  # no response with that id was stored
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


def test_vllm_prompt_logprobs_field(server, http, offline):
    """vLLM's prompt_logprobs extension: per prompt token (null first) a dict by token id of
    the token (with its rank) and its alternatives, equal to the offline engine's."""
    text = "Lily saw a big, red ball"
    ids = offline.engine.tokenizer.encode(text)
    ref = offline.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for k in range(1, len(ids)):
        entry, want = plp[k], ref.prompt_logprobs[k]
        mine = entry[str(ids[k])]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-5) and mine["rank"] == want.rank
        tops = sorted(want.top_logprobs.items(), key=lambda kv: -kv[1])
        for rank, (tid, lp) in enumerate(tops, start=1):
            assert entry[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-5)
            if tid != ids[k]:
                assert entry[str(tid)]["rank"] == rank
    # Each token's text in context: together, the prompt after BOS.
    assert "".join(e[str(t)]["decoded_token"] for e, t in zip(plp[1:], ids[1:])).strip() == text
    # Without the field, choices carry null.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert r.json()["choices"][0]["prompt_logprobs"] is None


def test_vllm_benchmark_stream_parsing_rules(server, http):
    """The parsing rules of vLLM's benchmark client (``async_request_openai_completions`` in
    vllm/benchmarks/lib/endpoint_request_func.py), reproduced: its payload, SSE messages split
    on blank lines, comments skipped, ``[DONE]`` ignored; a message with choices is a token
    event (TTFT on the first, an ITL gap after), one with only usage gives the token counts."""
    payload = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 16,
               "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True, "temperature": 0}
    events, output_tokens, prompt_len, text, buffer = 0, None, None, "", ""
    with http.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        for raw in r.iter_bytes():
            buffer += raw.decode()
            *messages, buffer = buffer.split("\n\n")
            for message in messages:
                message = message.strip()
                if not message or message.startswith(":"):
                    continue
                chunk = message.removeprefix("data: ")
                if chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    events += 1
                    text += choices[0].get("text") or ""
                elif usage := data.get("usage"):
                    output_tokens, prompt_len = usage["completion_tokens"], usage["prompt_tokens"]
    assert buffer.strip() == ""
    plain = http.post("/v1/completions", json={**payload, "stream": False}).json()
    assert text == plain["choices"][0]["text"]
    assert output_tokens == 16 and prompt_len == len(server.tokenizer.encode(PROMPT))
    # One event per token: TTFT plus 15 inter-token gaps, so its ITL and TPOT are per token.
    assert events == 16
