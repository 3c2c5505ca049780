"""vLLM's prompt forms in LLM.generate, and cache_salt from LLM.generate and over HTTP: a salted
request shares prefix-cache blocks only with requests of the same salt."""

from __future__ import annotations

import httpx
import pytest
from live import serve_in_thread
from paths import STORIES, STORIES_EXPECTED

from travelator import LLM, SamplingParams
from travelator.engine.async_engine import AsyncEngine
from travelator.prompts import Prompt, parse_prompts
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="shared/models not present")

GREEDY = SamplingParams(temperature=0, max_tokens=5)
LONG = STORIES_EXPECTED  # long enough for full blocks of 16 tokens to share


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES), dtype="float32", max_model_len=128, num_kv_blocks=64)


def shareable(llm: LLM) -> int:
    """The tokens of LONG in full blocks, at least one token left to compute."""
    n = (len(llm.tokenizer.encode(LONG)) - 1) // 16 * 16
    assert n >= 32
    return n


def hits(llm: LLM, prompt) -> int:
    """Prompt tokens served from the prefix cache for one generation of ``prompt``."""
    before = llm.engine.kv.stats.hit_tokens
    llm.generate(prompt, GREEDY, use_tqdm=False)
    return llm.engine.kv.stats.hit_tokens - before


def test_prompt_dicts_give_the_same_answers_as_plain_prompts(llm):
    ids = llm.tokenizer.encode("Once upon a time")
    plain = llm.generate(["Once upon a time", ids], GREEDY, use_tqdm=False)
    forms = llm.generate([{"prompt": "Once upon a time"}, {"prompt_token_ids": ids}], GREEDY,
                         use_tqdm=False)
    assert [r.text for r in forms] == [r.text for r in plain] == [", there was a little"] * 2
    assert [r.prompt for r in forms] == ["Once upon a time", None]
    assert forms[1].prompt_token_ids == ids
    single = llm.generate({"prompt": "Once upon a time"}, GREEDY, use_tqdm=False)
    assert [r.text for r in single] == [", there was a little"]


def test_prompt_forms_are_parsed_strictly():
    assert parse_prompts([1, 2]) == [Prompt(None, [1, 2])]
    assert parse_prompts({"prompt": "a", "cache_salt": "s"}) == [Prompt("a", None, "s")]
    assert parse_prompts(["a", [3], {"prompt_token_ids": (4, 5)}]) == [
        Prompt("a", None), Prompt(None, [3]), Prompt(None, [4, 5])]
    with pytest.raises(ValueError, match=r"unsupported prompt fields \['multi_modal_data'\]"):
        parse_prompts({"prompt": "a", "multi_modal_data": {}})
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
        parse_prompts({"prompt": "a", "prompt_token_ids": [1]})
    with pytest.raises(TypeError, match="cache_salt must be a string"):
        parse_prompts({"prompt": "a", "cache_salt": 7})
    with pytest.raises(TypeError, match="token ids go in 'prompt_token_ids'"):
        parse_prompts({"prompt": [1, 2]})


def test_cache_salt_in_generate_changes_the_prefix_cache_key(llm):
    full = shareable(llm)
    hits(llm, LONG)  # warm: its full blocks are now cached, unsalted
    assert hits(llm, LONG) == full
    assert hits(llm, {"prompt": LONG, "cache_salt": "alice"}) == 0  # another key: a miss
    assert hits(llm, {"prompt": LONG, "cache_salt": "alice"}) == full  # same salt: a hit
    assert hits(llm, {"prompt": LONG, "cache_salt": "bob"}) == 0
    ids = llm.tokenizer.encode(LONG)
    assert hits(llm, {"prompt_token_ids": ids, "cache_salt": "bob"}) == full
    assert hits(llm, LONG) == full  # the unsalted blocks are still there


@pytest.fixture(scope="module")
def http(llm):
    app = build_app(AsyncEngine(llm.engine), ServerSettings())
    with (serve_in_thread(app, name="salt-uvicorn") as url,
          httpx.Client(base_url=url, timeout=30) as client):
        yield client


def cached_tokens(http, path: str, **body) -> int:
    if path == "/v1/completions":
        body.setdefault("prompt", LONG)
    r = http.post(path, json={"max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_over_http_changes_the_prefix_cache_key(llm, http):
    full = shareable(llm)
    cached_tokens(http, "/v1/completions")
    assert cached_tokens(http, "/v1/completions") == full
    assert cached_tokens(http, "/v1/completions", cache_salt="tenant-1") == 0
    assert cached_tokens(http, "/v1/completions", cache_salt="tenant-1") == full
    assert cached_tokens(http, "/v1/completions", cache_salt="tenant-2") == 0
    messages = [{"role": "user", "content": LONG}]
    cached_tokens(http, "/v1/chat/completions", messages=messages, cache_salt="tenant-3")
    assert cached_tokens(http, "/v1/chat/completions", messages=messages, cache_salt="tenant-3") > 0
    assert cached_tokens(http, "/v1/chat/completions", messages=messages, cache_salt="tenant-4") == 0


def test_an_empty_cache_salt_is_refused(http):
    r = http.post("/v1/completions", json={"prompt": "Once", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_errors_name_the_field_at_fault(http):
    r = http.post("/v1/completions", json={"prompt": "Once", "stop_token_ids": [99999]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stop_token_ids"
    r = http.post("/v1/completions", json={"prompt": "Once", "min_tokens": 9, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
