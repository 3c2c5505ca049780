"""A short soak and chaos run (travelator bench soak) on stories260K, and the self-checks it relies on.

The soak starts `travelator serve` itself (one torch thread, a KV pool of 24 blocks so that
requests are preempted, a waiting queue of 32 so that bursts get 503), sends a few hundred mixed
requests with client disconnects and bursts, and checks the engine's own accounting at rest.
The long run (2,000+ requests) is not part of CI: see docs/reliability.md.
"""

from __future__ import annotations

import contextlib

import httpx

from paths import STORIES, needs_stories
from live import serve_in_thread
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.engine.request import RequestSpec
from travelator.engine.self_check import engine_self_check
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings
from travelator.bench.soak.config import SoakConfig
from travelator.bench.soak.driver import phases, run_soak
from travelator.bench.soak.structured import CHOICES, REGEXES, SCHEMAS, Constraint

pytestmark = needs_stories


def test_short_soak_loses_nothing(capsys):
    result = run_soak(SoakConfig(model=str(STORIES), requests=200, seed=1, time_limit_s=170))
    line = result.line()
    with capsys.disabled():
        print("\n" + line)
    assert result.ok, "\n".join(result.failures[:20])
    assert line.startswith("soak: sent=200 ") and line.endswith("result=PASS")
    assert result.sent == 200
    # The chaos really happened...
    assert result.disconnected > 0 and result.rejected_503 > 0 and result.preemptions > 0
    assert result.invalid_4xx > 0
    # ...and nothing was lost to it.
    assert result.leaked_blocks == 0 and result.server_errors_5xx == 0
    assert result.completed + result.disconnected + result.rejected_503 + result.invalid_4xx == result.sent
    assert result.completed > result.sent // 2


def test_disaggregated_soak_survives_a_killed_decode_worker(capsys):
    """The same chaos on ``serve --disaggregate 1:2``, and one decode worker SIGKILLed a third of
    the way in: only its requests fail, and the survivors hold no block once idle."""
    result = run_soak(SoakConfig(model=str(STORIES), requests=300, seed=2, time_limit_s=200,
                                 disaggregate="1:2", kill_decode_worker_after=100))
    line = result.line()
    with capsys.disabled():
        print("\n" + line)
    assert result.ok, "\n".join(result.failures[:20])
    assert result.killed_worker == "decode worker 1"
    assert result.leaked_blocks == 0 and result.server_errors_5xx == 0
    assert result.disconnected > 0 and result.rejected_503 > 0 and result.preemptions > 0
    assert (result.completed + result.disconnected + result.rejected_503 + result.invalid_4xx + result.killed
            == result.sent)


def test_everything_soak_keeps_every_promise(capsys):
    """Structured outputs, priorities, shared prefixes and speculative decoding (n-gram, then a
    draft model) on a batch-invariant server, with the usual chaos: every finished constrained
    answer satisfies its constraint, and every greedy answer equals the same request alone."""
    result = run_soak(SoakConfig(model=str(STORIES), requests=300, seed=5, time_limit_s=240, everything=True))
    line = result.line()
    with capsys.disabled():
        print("\n" + line)
    assert result.ok, "\n".join(result.failures[:20])
    assert result.phases == ["ngram", "draft"]
    assert result.leaked_blocks == 0 and result.server_errors_5xx == 0
    assert result.disconnected > 0 and result.rejected_503 > 0 and result.preemptions > 0
    assert 0 < result.constrained_valid == result.constrained_checked
    assert 0 < result.greedy_equal == result.greedy_compared
    assert result.prefix_hit_tokens > 0 and result.accepted_draft_tokens > 0
    assert len(result.priorities) > 1


def test_constraint_checks_tell_valid_from_invalid():
    person = Constraint("json", SCHEMAS[0])
    assert person.check('{"name": "Lily", "age": 5}') is None
    assert "not valid" in person.check('{"name": "Lily", "age": 500}')
    assert "not valid" in person.check('\ufffd"name": "Lily", "age": 5}')  # not JSON
    assert Constraint("regex", REGEXES[0]).check("Ben was happy.") is None
    assert Constraint("regex", REGEXES[0]).check("Ben was happy. ") is not None  # a full match
    assert Constraint("choice", CHOICES[1]).check("yes") is None
    assert Constraint("choice", CHOICES[1]).check("yes!") is not None


def test_everything_phases_follow_what_the_server_supports():
    assert phases(SoakConfig(everything=True)) == (["ngram", "draft"], [])
    assert phases(SoakConfig(everything=True, disaggregate="1:2")) == (["ngram"], ["structured_outputs", "draft_model"])
    assert phases(SoakConfig(everything=True, url="http://127.0.0.1:1")) == ([None], [])
    assert phases(SoakConfig()) == ([None], [])


@contextlib.contextmanager
def live_server(llm: LLM, **settings):
    app = build_app(AsyncEngine(llm.engine), ServerSettings(**settings))
    with serve_in_thread(app, name="soak-uvicorn") as url:
        yield url


def _leak_two_blocks(llm: LLM) -> str:
    """Take KV blocks for a request the scheduler never heard of: a leak, as a bug would make."""
    engine = llm.engine
    req = engine.make_request(RequestSpec(list(range(1, 21)), request_id="leaky"))
    assert engine.kv.allocate_slots(req, 20) is not None  # 20 tokens: 2 blocks of 16
    return req.request_id


def test_self_check_sees_a_leak():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=16, max_model_len=128)
    engine = llm.engine
    clean = engine_self_check(engine)
    assert clean["ok"] and clean["idle"] and clean["kv"]["free_blocks"] == 16 and clean["kv"]["leaked_blocks"] == 0

    rid = _leak_two_blocks(llm)
    report = engine_self_check(engine)
    assert not report["ok"]
    assert report["kv"]["used_blocks"] == 2 and report["kv"]["leaked_blocks"] == 2
    assert report["kv"]["free_blocks"] + report["kv"]["used_blocks"] == report["kv"]["total_blocks"]
    assert report["kv"]["owners"] == {rid: 2}
    assert any("does not know" in p and rid in p for p in report["problems"])

    engine.kv.free(rid)
    assert engine_self_check(engine)["ok"]

    # A corrupted pool fails its own consistency check, and the report says so.
    engine.kv._ref_cnt[3] = 1  # noqa: SLF001 - deliberate corruption
    report = engine_self_check(engine)
    assert not report["ok"] and report["kv"]["consistency"].startswith("failed")
    engine.kv._ref_cnt[3] = 0  # noqa: SLF001


def test_self_check_sees_a_lost_block():
    """Free and used blocks are counted independently, so their sum can miss the total."""
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=16, max_model_len=128)
    engine = llm.engine
    engine.kv._free.pop_first()  # a block vanishes from the pool
    report = engine_self_check(engine)
    assert not report["ok"] and not report["kv"]["free_plus_used_equals_total"]
    assert "free 15 + used 0 != total 16 blocks" in report["problems"]
    assert report["kv"]["consistency"].startswith("failed: blocks in no block table and not free")


def test_debug_endpoint_is_off_by_default_and_guarded_by_the_key():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=16, max_model_len=128)
    with live_server(llm) as url:
        assert httpx.get(f"{url}/debug/engine").status_code == 404
    with live_server(llm, enable_debug_endpoints=True, api_key="k") as url:
        assert httpx.get(f"{url}/debug/engine").status_code == 401
        r = httpx.get(f"{url}/debug/engine", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["ok"] and r.json()["idle"]
        metrics = httpx.get(f"{url}/metrics").text
        for name in ("kv_cache_free_blocks", "kv_cache_used_blocks", "kv_cache_total_blocks", "engine_healthy"):
            assert f"travelator_{name}{{" in metrics


def test_soak_fails_on_a_leak():
    """The harness's checks bite: a server that leaked KV blocks fails the soak, with the figure."""
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=32, max_model_len=128)
    with live_server(llm, enable_debug_endpoints=True) as url:
        _leak_two_blocks(llm)
        result = run_soak(SoakConfig(url=url, requests=20, burst_every=0, disconnect_rate=0, invalid_rate=0,
                                     time_limit_s=60))
    assert not result.ok
    assert result.leaked_blocks == 2
    assert result.completed == 20
    assert any("still in use at rest" in f for f in result.failures)
    assert "leaked_blocks=2" in result.line() and "result=FAIL" in result.line()
