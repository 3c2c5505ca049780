"""``travelator serve --disaggregate``: prefill and decode workers in their own processes.

Against the single engine (stories260K, float32, batch-invariant: the same numbers whatever
the batch, so the comparison is exact): the same greedy text, streamed or not, with the front
end holding requests back while the decode pools are full. Then the faults: a client that
leaves, and a decode worker killed while it serves; the survivors keep serving and hold no
block once idle."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from paths import STORIES, needs_stories

from travelator import LLM, SamplingParams
from travelator.disagg import messages as m
from travelator.disagg.placement import Placement
from travelator.disagg.router import Router
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request
from travelator.server.process import ServerProcess, free_port, serve_command

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", batch_invariant=True, block_size=8)
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--batch-invariant", "--block-size", "8"]
# 200 tokens or so: 26 blocks of 8, so that a 40-block decode pool holds one such request.
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 10
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day", LONG,
           LONG + " Then", "Tom had a ball", LONG + " The end."]


# ---- placement, by hand -----------------------------------------------------------------
def test_placement_prefers_room_then_holds_back():
    p = Placement(num_prefill=2, decode_free_blocks=[10, 6])
    assert p.choose_decode(4) == 0  # most room
    p.promise(0, "a", 5)  # rooms now 5 and 6
    assert p.choose_decode(4) == 1
    p.promise(1, "b", 4)  # rooms 5 and 2
    assert p.choose_decode(6) is None  # nobody has 6: the request waits
    p.report(0, free_blocks=10, running=0)
    p.release(0, "a")  # running there now, in its report: rooms 10 and 2
    assert p.choose_decode(6) == 0
    p.mark_dead("decode", 0)
    assert p.choose_decode(1) == 1
    assert p.choose_decode(3) is None
    # Prefill: fewest prompt tokens outstanding, then the lowest index.
    assert p.choose_prefill() == 0
    p.prefill_sent(0, "a", 100)
    assert p.choose_prefill() == 1
    p.prefill_sent(1, "b", 300)
    assert p.choose_prefill() == 0
    p.prefill_done(1, "b")
    assert p.choose_prefill() == 1
    p.mark_dead("prefill", 1)
    assert p.choose_prefill() == 0 and p.alive("prefill") == 1 and p.alive("decode") == 1


# ---- the router, by hand ---------------------------------------------------------------------
def _router(decode_blocks=(8,), block_size=4):
    sent, pushed = [], []
    router = Router(Placement(1, list(decode_blocks)), block_size, lambda w, c: sent.append((str(w), c)),
                    lambda rid, o: pushed.append(o))
    return router, sent, pushed


def _request(rid: str, prompt_len: int = 6, max_tokens: int = 3) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)),
                   sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   eos_token_ids=frozenset())


def _stats(free_blocks: int = 8, running: int = 0) -> m.WorkerStats:
    return m.WorkerStats(free_blocks=free_blocks, used_blocks=0, total_blocks=8, cached_blocks=0,
                         running=running, waiting=0, counters={})


def _out(rid: str, tokens: list[int], finished: bool, reason: str | None = None, text: str = "") -> RequestOutput:
    return RequestOutput(rid, [1], tokens, text, new_token_ids=tokens[-1:], finished=finished,
                         finish_reason=reason)


PREFILL0, DECODE0 = m.WorkerId(m.PREFILL, 0), m.WorkerId(m.DECODE, 0)


def test_router_passes_decode_outputs_that_overtook_the_first_token_after_it():
    router, sent, pushed = _router()
    router.add(_request("A"))
    assert [(w, type(c).__name__) for w, c in sent] == [("decode worker 0", "Expect"), ("prefill worker 0", "Submit")]
    # The decode worker's report (the last token) comes before the prefill worker's.
    router.on_report(m.Report(DECODE0, [_out("A", [7, 8], False), _out("A", [7, 8, 9], True, "length")],
                              _stats(), admitted=["A"]))
    assert pushed == []
    router.on_report(m.Report(PREFILL0, [_out("A", [7], True, "length", "x")], _stats(), handed_off=["A"]))
    assert [(o.output_token_ids, o.finished, o.finish_reason) for o in pushed] == [
        ([7], False, None), ([7, 8], False, None), ([7, 8, 9], True, "length")]
    assert not router.routes and not router.placement.decode[0].promised


def test_router_holds_requests_back_until_a_decode_pool_has_room():
    router, sent, _ = _router(decode_blocks=(4,), block_size=4)
    router.add(_request("A", prompt_len=10))  # 11 tokens of KV: 3 blocks promised
    router.add(_request("B", prompt_len=10))  # 3 more do not fit in the 1 left
    assert list(router.waiting) == ["B"] and [c.request_id for _, c in sent] == ["A", "A"]
    router.on_report(m.Report(DECODE0, [], _stats(free_blocks=1, running=1), admitted=["A"]))
    assert list(router.waiting) == ["B"]  # A holds its blocks now; still no room
    router.on_report(m.Report(DECODE0, [_out("A", [5, 6, 7], True, "length")], _stats(free_blocks=4)))
    assert not router.waiting and [c.request_id for _, c in sent][-2:] == ["B", "B"]


def test_router_abort_during_prefill_and_a_dead_decode_worker():
    router, sent, pushed = _router(decode_blocks=(8, 8))
    router.add(_request("A"))
    router.add(_request("B"))  # the other decode worker (most room)
    assert router.routes["A"].decode == 0 and router.routes["B"].decode == 1
    sent.clear()
    router.abort("A")  # the client left while A is at its prefill
    assert {(w, type(c).__name__) for w, c in sent} == {("decode worker 0", "Abort"), ("prefill worker 0", "Abort")}
    router.on_report(m.Report(PREFILL0, [_out("A", [], True, "abort")], _stats()))
    assert ("decode worker 0", "Forget") in [(w, type(c).__name__) for w, c in sent[-1:]]
    assert "A" not in router.routes and pushed == []
    # B's first token went out, then its decode worker dies: B fails, naming it.
    router.on_report(m.Report(PREFILL0, [_out("B", [4], True, "length")], _stats(), handed_off=["B"]))
    router.on_death(m.WorkerId(m.DECODE, 1), "exit code -9")
    assert [(o.finish_reason, o.error) for o in pushed] == [
        (None, None), ("error", "the decode worker 1 died (exit code -9)")]
    assert not router.routes and router.placement.choose_decode(1) == 0


def test_router_a_dead_prefill_worker_fails_only_what_it_held():
    router, sent, pushed = _router(decode_blocks=(8,))
    router.placement = Placement(2, [8])  # two prefill workers
    router.add(_request("A"))  # prefill worker 0 (fewest tokens outstanding)
    router.add(_request("B"))  # prefill worker 1
    assert (router.routes["A"].prefill, router.routes["B"].prefill) == (0, 1)
    router.on_report(m.Report(m.WorkerId(m.PREFILL, 1), [_out("B", [4], True, "length")], _stats(),
                              handed_off=["B"]))  # B is at its decode worker now
    sent.clear()
    router.on_death(PREFILL0, "exit code -9")
    assert [(o.request_id, o.finish_reason, o.error) for o in pushed if o.finished] == [
        ("A", "error", "the prefill worker 0 died (exit code -9)")]
    assert ("decode worker 0", "Forget") in [(w, type(c).__name__) for w, c in sent]  # A's KV never comes
    assert list(router.routes) == ["B"] and router.placement.choose_prefill() == 1
    router.add(_request("C"))
    assert router.routes["C"].prefill == 1


# ---- the server ----------------------------------------------------------------------------
def start_server(tmp_path_factory, layout: str, *extra: str) -> ServerProcess:
    args = ["--model", str(STORIES), *ENGINE_FLAGS, "--num-kv-blocks", "40", "--disaggregate", layout,
            "--worker-threads", "1", "--enable-debug-endpoints", *extra]
    # The port is free when chosen, but the workers' own connections, opened before the HTTP
    # server binds it, may take it first (seen once in a full run): then another port.
    for attempt in range(3):
        port = free_port()
        log = tmp_path_factory.mktemp("disagg") / "serve.log"
        server = ServerProcess(serve_command(args, port), port, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT,
                               log_path=log)
        try:
            server.start(timeout=240)
            return server
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == 2:
                pytest.fail(str(exc))  # raises: the loop never runs out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not found")
    server = start_server(tmp_path_factory, "1:2")
    try:
        yield SimpleNamespace(url=server.base_url, server=server)
    finally:
        server.close()


def reference(prompts: list[str], max_tokens: int) -> list[str]:
    llm = LLM(str(STORIES), **ENGINE, max_model_len=320)
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return [r.outputs[0].text for r in results]


def complete(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = httpx.get(f"{url}/debug/engine", timeout=30).json()
        if report["idle"]:
            return report
        assert time.monotonic() < deadline, f"not idle: {json.dumps(report)[:2000]}"
        time.sleep(0.2)


def assert_clean(report: dict) -> None:
    assert report["ok"], report["problems"]
    assert report["kv"]["used_blocks"] == 0 and report["kv"]["free_plus_used_equals_total"]
    assert report["routes"] == 0 and report["streams"] == 0
    for name, w in report["workers"].items():
        if w["alive"]:
            assert w["worker"] and not any(w["worker"].values()), (name, w["worker"])


@needs_stories
def test_concurrent_requests_give_the_single_engines_text(served):
    """Eight at once, three of ~200 tokens: a 40-block decode pool holds one long request, so
    the front end holds the others back until a decode worker has room; none is lost."""
    max_tokens = 24
    expected = reference(PROMPTS, max_tokens)
    got: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        got[i] = complete(served.url, PROMPTS[i], max_tokens)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, text in enumerate(expected):
        assert got[i].status_code == 200, got[i].text
        choice = got[i].json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, "length"), PROMPTS[i][:40]
        assert got[i].json()["usage"]["completion_tokens"] == max_tokens
    assert_clean(wait_idle(served.url))
    # Every prompt's KV moved (the workers' figures reach /metrics within a second at rest).
    deadline = time.monotonic() + 5
    while metric(served.url, 'travelator_disagg_kv_transfers_total{index="0",role="prefill"}') < len(PROMPTS):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert metric(served.url, 'travelator_disagg_kv_transfer_bytes_total{index="0",role="prefill"}') > 0


def metric(url: str, prefix: str) -> float:
    lines = [ln for ln in httpx.get(f"{url}/metrics").text.splitlines() if ln.startswith(prefix)]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


@needs_stories
def test_embeddings_through_the_prefill_workers(served):
    """Prompt-only requests end on a prefill worker: their vectors cross to the front end, and
    no block is left held anywhere."""
    llm = LLM(str(STORIES), **ENGINE, max_model_len=320)
    texts = PROMPTS[:4]
    got = httpx.post(f"{served.url}/v1/embeddings", timeout=120, json={"input": texts}).json()
    for d, want in zip(got["data"], llm.embed(texts, use_tqdm=False)):
        assert d["embedding"] == pytest.approx(want, abs=1e-5)
    assert_clean(wait_idle(served.url))


@needs_stories
def test_streamed_text_and_one_token_requests(served):
    expected = reference(["The little dog"], 30)[0]
    chunks = []
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60, json={
            "prompt": "The little dog", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == expected
    assert [c["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["finish_reason"] is None for c in chunks[:-1])  # the hand-off is not an end
    # max_tokens 1: the prefill worker's token is the whole answer; no KV moves.
    one = complete(served.url, "One day", 1).json()["choices"][0]
    assert (one["text"], one["finish_reason"]) == (reference(["One day"], 1)[0], "length")
    assert_clean(wait_idle(served.url))


@needs_stories
def test_a_client_that_leaves_frees_everything(served):
    wait_idle(served.url)
    time.sleep(1.2)  # the workers' figures at rest
    before = metric(served.url, "travelator_generation_tokens_total")
    for _ in range(3):
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 280, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # leaves mid-stream: the abort must reach the decode worker
    assert_clean(wait_idle(served.url))
    time.sleep(1.2)
    # The decode worker stopped them: far fewer tokens than 3 x 280 were generated.
    assert metric(served.url, "travelator_generation_tokens_total") - before < 280


@needs_stories
def test_a_killed_decode_worker_fails_only_its_requests(tmp_path_factory):
    server = start_server(tmp_path_factory, "1:2")
    url = server.base_url
    try:
        report = httpx.get(f"{url}/debug/engine").json()
        victim = report["workers"]["decode worker 1"]["pid"]
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            try:
                results[i] = complete(url, PROMPTS[i % 4], 280)
            except httpx.HTTPError as exc:  # a hang: reported by the assertion below, with the log
                results[i] = SimpleNamespace(status_code=repr(exc), json=lambda: {"error": {"message": ""}})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while True:  # both decode workers busy
            running = [metric(url, f'travelator_disagg_worker_running{{index="{d}",role="decode"}}') for d in (0, 1)]
            if all(running):
                break
            assert time.monotonic() < deadline, running
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join()
        codes = [r.status_code for r in results.values()]
        failed = [r.json()["error"] for r in results.values() if r.status_code != 200]
        assert failed and 200 in codes, (codes, server.log_tail(60))
        assert all("decode worker 1 died" in e["message"] for e in failed), failed
        assert all(r.json()["choices"][0]["finish_reason"] == "length"
                   for r in results.values() if r.status_code == 200)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        # Still serving, on the survivor, with the single engine's text.
        r = complete(url, "Once upon a time", 20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(["Once upon a time"], 20)[0]
        report = wait_idle(url)
        assert_clean(report)
        assert not report["workers"]["decode worker 1"]["alive"]
        assert 'travelator_disagg_worker_alive{index="1",role="decode"} 0.0' in httpx.get(f"{url}/metrics").text
    finally:
        server.close()
