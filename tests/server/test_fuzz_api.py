"""Fuzzing the HTTP API from its own OpenAPI schema: no 5xx, no crash, no hang, nothing leaked.

Request bodies are generated (hypothesis-jsonschema) from the components of the server's
``/openapi.json``: schema-valid bodies as they come, the same bodies nudged into ranges the
engine accepts (so many of them really generate), schema-valid bodies with one field replaced by
any JSON value, arbitrary JSON and raw bytes. Every answer must be below 500 with an OpenAI error
body, or a valid completion (a stream that ends in ``[DONE]`` with no internal error event); and
when the fuzzing is over, the engine's self-check must find it idle with every KV block back.

The server is small on purpose (context 64 tokens, at most 8 choices per request), so that every
request, valid or not, ends in well under a second: a hang is a 30-second timeout.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from types import SimpleNamespace

import httpx
import hypothesis_jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paths import STORIES, needs_stories
from live import serve_in_thread
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

pytestmark = needs_stories

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # every request here ends in well under a second


@pytest.fixture(scope="module")
def server():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=16, max_model_len=64)
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, ServerSettings(max_n=4, max_choices_per_request=8, max_body_bytes=64 * 1024,
                                                 enable_debug_endpoints=True))
    with serve_in_thread(app, name="fuzz-uvicorn", log_level="error") as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            schema = http.get("/openapi.json").json()
            yield SimpleNamespace(url=url, http=http, schema=schema, engine=llm.engine)


def _body_strategy(schema: dict, name: str):
    root = {"$ref": f"#/components/schemas/{name}", "components": schema["components"]}
    return hypothesis_jsonschema.from_schema(root)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)

# Fields an engine request can take, with values it accepts: mixed into schema-valid bodies so that
# many fuzzed requests get past validation and really generate.
_PLAUSIBLE = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "echo": st.booleans(),
})


def _nudged(body_strategy, chat: bool):
    def merge(body: dict, extra: dict) -> dict:
        body = {**body, **extra}
        body.pop("model", None)
        body.pop("max_completion_tokens", None)
        if chat:
            body.pop("echo", None)
            if "logprobs" in body:
                body["logprobs"] = bool(body["logprobs"])
                body["top_logprobs"] = min(extra.get("logprobs", 0), 5) if body["logprobs"] else None
        return body

    return st.builds(merge, body_strategy, _PLAUSIBLE)


def _mutated(body_strategy):
    def mutate(body: dict, key: str, value) -> dict:
        return {**body, key: value}

    keys = st.sampled_from(["prompt", "messages", "max_tokens", "n", "stop", "temperature", "seed", "logprobs",
                            "top_logprobs", "stream", "stream_options", "stop_token_ids", "priority", "model",
                            "logit_bias", "response_format", "tools", "echo"])
    return st.builds(mutate, body_strategy, keys, _json)


def check_answer(r: httpx.Response, what) -> None:
    """Below 500; a 4xx has the OpenAI error body; a 200 is a valid completion or stream."""
    assert r.status_code < 500, (r.status_code, r.text[:500], what)
    ctype = r.headers.get("content-type", "")
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (err, what)
        assert isinstance(err["message"], str) and err["message"], (err, what)
        return
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (events[-3:], what)
        for raw in events[:-1]:
            chunk = json.loads(raw)
            if "error" in chunk:  # allowed only for a request the engine refused, never a crash
                assert chunk["error"]["type"] == "invalid_request_error", (chunk, what)
    else:
        data = r.json()
        if "choices" in data:
            for c in data["choices"]:
                assert c["finish_reason"] in ("stop", "length"), (c, what)


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return server.http.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,model", [("/v1/completions", "CompletionRequest"),
                                        ("/v1/chat/completions", "ChatCompletionRequest")])
def test_schema_bodies(server, path, model):
    bodies = _body_strategy(server.schema, model)
    chat = "chat" in path

    @FUZZ
    @given(st.one_of(bodies, _nudged(bodies, chat), _mutated(bodies)))
    def run(body):
        check_answer(post(server, path, body), body)

    run()
    assert_back_at_rest(server)


def test_the_schema_describes_the_bodies(server):
    schemas = server.schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = server.schema["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert model in schemas
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]


def test_arbitrary_bodies(server):
    @FUZZ
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           body=st.one_of(_json, st.binary(max_size=200)))
    def run(path, body):
        check_answer(post(server, path, body), body)

    run()
    assert_back_at_rest(server)


@FUZZ
@given(name=st.text(max_size=30), method=st.sampled_from(["GET", "POST", "DELETE"]))
def test_other_routes(server, name, method):
    quoted = urllib.parse.quote(name, safe="")
    for path in (f"/v1/models/{quoted}", f"/v1/{quoted}"):
        check_answer(server.http.request(method, path), (method, path))


def assert_back_at_rest(server) -> None:
    """Whatever was sent, the engine is back at rest: idle, every KV block back, no errors."""
    deadline = time.monotonic() + 10
    while True:
        report = server.http.get("/debug/engine").json()
        if report["idle"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert report["idle"], report
    assert report["ok"], report["problems"]
    assert report["kv"]["used_blocks"] == 0 and report["kv"]["free_blocks"] == report["kv"]["total_blocks"]
    assert report["counters"]["finished"].get("error", 0) == 0
    assert server.http.get("/health").status_code == 200
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ", there was a little"


def test_idle_and_nothing_leaked_after_a_mixed_batch(server):
    """On its own, in any order: valid, streamed, cut-short and invalid requests, then at rest."""
    bodies = [
        {"prompt": "Once upon a time", "max_tokens": 8, "n": 2},
        {"prompt": ["Lily", "Ben"], "max_tokens": 4, "stream": True, "logprobs": 2},
        {"prompt": [1, 10**9]},
        {"prompt": "Once", "max_tokens": 10**6},
        {"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4},
    ]
    for body in bodies:
        check_answer(post(server, "/v1/completions", body), body)
    with server.http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "stream": True,
            "ignore_eos": True}) as r:
        next(r.iter_lines())  # leave after the first event: the server must abort the rest
    assert_back_at_rest(server)
