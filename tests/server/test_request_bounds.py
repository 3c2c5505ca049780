"""Inputs that would stall or corrupt every request get a 400 naming the field: NaN and
Infinity, too many or too long stop strings, too many stop tokens, a priority out of range.

One live server with its limits set (stories260K in float32)."""

from __future__ import annotations

import json

import httpx
import pytest

from live import serve_in_thread
from paths import STORIES, needs_stories
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.sampling_params import StopLimits
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

pytestmark = needs_stories

MODEL = "stories"
PROMPT = "Once upon a time"
LIMITS = StopLimits(max_stop_strings=2000, max_stop_string_chars=300, max_stop_token_ids=8)


@pytest.fixture(scope="module")
def http():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=256)
    settings = ServerSettings(served_model_names=[MODEL], stop_limits=LIMITS, priority_range=(-5, 5))
    app = build_app(AsyncEngine(llm.engine), settings)
    with serve_in_thread(app, log_level="warning") as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def _raw(path: str, fields: str) -> tuple[str, bytes]:
    """A body written by hand, for what json.dumps would not write (bare NaN, 1e999)."""
    if path == "/v1/chat/completions":
        head = f'"model": "{MODEL}", "messages": [{{"role": "user", "content": "{PROMPT}"}}]'
    elif path == "/v1/responses":
        head = f'"model": "{MODEL}", "input": "{PROMPT}"'
    else:
        head = f'"model": "{MODEL}", "prompt": "{PROMPT}"'
    return path, f'{{{head}, "max_tokens": 4, {fields}}}'.encode()


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}).encode()


def _post(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


NON_FINITE = [
    # (path, fields, param)
    ("/v1/completions", '"temperature": NaN', "temperature"),
    ("/v1/completions", '"temperature": Infinity', "temperature"),
    ("/v1/completions", '"temperature": 1e999', "temperature"),
    ("/v1/completions", '"repetition_penalty": NaN', "repetition_penalty"),
    ("/v1/completions", '"repetition_penalty": 1e999', "repetition_penalty"),
    ("/v1/completions", '"top_p": -Infinity', "top_p"),
    ("/v1/completions", '"min_p": NaN', "min_p"),
    ("/v1/completions", '"presence_penalty": 1e999', "presence_penalty"),
    ("/v1/completions", '"frequency_penalty": -1e999', "frequency_penalty"),
    ("/v1/completions", '"logit_bias": {"5": NaN}', "logit_bias.5"),
    ("/v1/chat/completions", '"temperature": NaN', "temperature"),
    ("/v1/chat/completions", '"repetition_penalty": -Infinity', "repetition_penalty"),
    ("/v1/responses", '"top_p": 1e999', "top_p"),
    ("/v1/responses", '"temperature": Infinity', "temperature"),
]


@pytest.mark.parametrize("path,fields,param", NON_FINITE, ids=[f"{p}:{f}" for p, f, _ in NON_FINITE])
def test_nan_and_infinity_are_refused_by_name(http, path, fields, param):
    r = _post(http, *_raw(path, fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "finite" in err["message"]


@pytest.mark.parametrize("fields", ['"response_format": {"type": "text", "x": NaN}',
                                    '"an_ignored_field": [Infinity]'])
def test_nan_anywhere_else_makes_the_body_invalid(http, fields):
    r = _post(http, *_raw("/v1/completions", fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    assert "NaN and Infinity" in r.json()["error"]["message"]


def test_the_words_inside_strings_are_text(http):
    r = _post(http, "/v1/completions", _body(prompt="NaN Infinity"))
    assert r.status_code == 200, r.text


OVER_LIMITS = [
    # (name, fields, param)
    ("too many stop strings", {"stop": [f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]}, "stop"),
    ("too long a stop string", {"stop": ["x", "y" * (LIMITS.max_stop_string_chars + 1)]}, "stop"),
    ("too many stop tokens", {"stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))}, "stop_token_ids"),
    ("priority above", {"priority": 6}, "priority"),
    ("priority below", {"priority": -6}, "priority"),
    ("priority huge", {"priority": 10**40}, "priority"),
    # Integers past 64 bits (or far past any model) would not travel to tensor-parallel ranks.
    ("top_k huge", {"top_k": 10**20}, "top_k"),
    ("min_tokens huge", {"min_tokens": 10**12}, "min_tokens"),
    ("stop token id huge", {"stop_token_ids": [2**40]}, "stop_token_ids"),
    ("schema integer huge", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "maximum": 10**20}}}}, "response_format"),
]


@pytest.mark.parametrize("fields,param", [b[1:] for b in OVER_LIMITS], ids=[b[0] for b in OVER_LIMITS])
def test_over_the_limits_is_a_400_naming_the_field(http, fields, param):
    for path, body in [("/v1/completions", _body(**fields)),
                       ("/v1/chat/completions", json.dumps({
                           "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                           **fields}).encode())]:
        r = _post(http, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err


def test_the_largest_seed_gives_every_choice_a_64_bit_seed(http):
    r = _post(http, "/v1/completions", _body(max_tokens=4, n=2, seed=2**64 - 1))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_within_raised_limits_many_stop_strings_still_stop(http):
    greedy = _post(http, "/v1/completions", _body(max_tokens=16, temperature=0)).json()["choices"][0]["text"]
    word = greedy.split()[2]
    # Many strings that begin like the text (long partial matches), and one that ends it.
    stops = [greedy[: i % 10 + 1] + f"#{i}" for i in range(LIMITS.max_stop_strings - 1)] + [word]
    r = _post(http, "/v1/completions", _body(max_tokens=16, temperature=0, stop=stops,
                                             stop_token_ids=list(range(8)), priority=-5))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert choice["text"] == greedy[: greedy.index(word)]
