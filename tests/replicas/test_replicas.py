"""``travelator serve --data-parallel-size 2`` on stories260K: answers equal one engine's,
requests sharing a prefix go to one replica (whose prefix cache then hits), each replica
runs on its own cores, and a killed replica fails only its own requests and comes back; stored
responses are found on the replica that stored them; rerank and score answer as one engine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from paths import STORIES, STORIES_EXPECTED, needs_stories
from travelator import LLM, SamplingParams
from travelator.replicas.cores import parse_cpu_list
from travelator.scoring import ScoreFormat
from travelator.server.process import ServerProcess, free_port, serve_command

pytestmark = needs_stories
ROOT = Path(__file__).resolve().parents[2]

# Two system prompts of three blocks of routing text (64 characters each) and more.
SYSTEM = {
    "a": "Once upon a time there was a little dog named Max. Max liked to run in the big green park. ",
    "b": "One day a girl named Sue found a shiny red box under her bed. She wanted to open it, but ",
}
USERS = ["He saw a cat.", "It was very hot.", "Then mom came home."]
SCORE_FORMAT = ScoreFormat("q: {query} d: {document} ->", ("a", "b"))


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    port = free_port()
    args = ["--model", str(STORIES), "--dtype", "float32", "--served-model-name", "m",
            "--data-parallel-size", "2", "--score-template", SCORE_FORMAT.template,
            "--score-labels", ",".join(SCORE_FORMAT.labels)]
    server = ServerProcess(serve_command(args, port), port, cwd=ROOT,
                           log_path=tmp_path_factory.mktemp("replicas") / "front.log")
    try:
        try:
            server.start(timeout=300)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        yield server
    finally:
        server.stop(60)  # SIGTERM: the front end stops its replicas
        server.close()


@pytest.fixture(scope="module")
def engine():
    return LLM(str(STORIES), dtype="float32")


def _health(front) -> dict:
    return httpx.get(f"{front.base_url}/health", timeout=10).json()


def _replica_pids(front) -> dict[int, int]:
    """The replica processes (children of the front end), by the port each listens on."""
    pids = {}
    for task in Path(f"/proc/{front.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            pids[int(argv[argv.index(b"--port") + 1])] = int(pid)
    return pids


def _pid_of(front, replica: int) -> int:
    url = _health(front)["replicas"][replica]["url"]
    return _replica_pids(front)[int(url.rsplit(":", 1)[1])]


def _route_counts(front) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{front.base_url}/metrics", timeout=10).text
    return {(m[2], m[1]): float(m[3]) for m in
            re.finditer(r'^travelator_route_total\{reason="(\w+)",replica="(\d+)"\} (\S+)$', text, re.M)}


def test_answers_equal_one_engines(front, engine):
    client = openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="none")
    story = client.completions.create(model="m", prompt="Once upon a time", max_tokens=60, temperature=0)
    assert ("Once upon a time" + story.choices[0].text).startswith(STORIES_EXPECTED)
    prompts = [SYSTEM[k] + u for k in SYSTEM for u in USERS]
    expected = [r.outputs[0].text for r in engine.generate(
        prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)]
    for prompt, text in zip(prompts, expected):
        answer = client.completions.create(model="m", prompt=prompt, max_tokens=32, temperature=0)
        assert answer.choices[0].text == text
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=32, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text


def _complete(front, prompt: str) -> int:
    r = httpx.post(f"{front.base_url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return int(r.headers["x-travelator-replica"])


def test_shared_prefixes_stay_on_one_replica(front):
    # Prefixes no other test has sent, so that neither has a home yet.
    system = {k: "Sam said: " + text for k, text in SYSTEM.items()}
    before = _route_counts(front)
    body = {"prompt": system["a"] + USERS[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{front.base_url}/v1/completions", json=body, timeout=60) as held:
        home_a = int(held.headers["x-travelator-replica"])
        # Prefix "a" holds a request on its replica: "b", new, goes to the other one.
        home_b = _complete(front, system["b"] + USERS[0])
        assert home_b != home_a
        for _ in held.iter_lines():
            pass
    for user in USERS[1:]:
        assert _complete(front, system["a"] + user) == home_a
        assert _complete(front, system["b"] + user) == home_b
    after = _route_counts(front)
    prefix_routes = sum(after[k] - before.get(k, 0.0) for k in after if k[1] == "prefix")
    assert prefix_routes == 4
    for replica in _health(front)["replicas"]:  # and each replica's engine found the prefix cached
        text = httpx.get(f"{replica['url']}/metrics", timeout=10).text
        hits = re.search(r"^travelator_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        assert float(hits[1]) > 0


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def test_stored_responses_are_found_on_their_replica(front):
    url = f"{front.base_url}/v1/responses"
    held_prompt = "Ann said: " + SYSTEM["b"]  # a prefix no other test sends
    body = {"prompt": held_prompt, "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{front.base_url}/v1/completions", json=body, timeout=60) as held:
        busy = int(held.headers["x-travelator-replica"])
        first = httpx.post(url, timeout=60, json={"input": "Tell me a story.", "max_output_tokens": 8,
                                                  "temperature": 0})
    assert first.status_code == 200, first.text
    home = int(first.headers["x-travelator-replica"])
    assert home != busy  # the least loaded one, while the other held a stream
    stored = first.json()
    got = httpx.get(f"{url}/{stored['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == first.json()
    # By its text alone the follow-up would go to ``busy``, where its prefix went: it must go
    # to ``home``, the only replica that holds the conversation. Streamed, and stored too.
    question = held_prompt + "What next?"
    follow = httpx.post(url, timeout=60, json={"input": question, "previous_response_id": stored["id"],
                                               "max_output_tokens": 4, "temperature": 0, "stream": True})
    assert follow.status_code == 200 and int(follow.headers["x-travelator-replica"]) == home
    (done,) = [e["response"] for e in _sse_events(follow.text) 
                if e["type"] in ("response.completed", "response.incomplete")]
    # One server sent the same conversation in full, stored nowhere, counts the same prompt.
    conversation = [{"role": "user", "content": "Tell me a story."},
                    {"role": "assistant", "content": _output_text(stored)}, {"role": "user", "content": question}]
    single = httpx.post(f"{_health(front)['replicas'][busy]['url']}/v1/responses", timeout=60,
                        json={"input": conversation, "max_output_tokens": 1, "store": False}).json()
    assert done["usage"]["input_tokens"] == single["usage"]["input_tokens"] > 0
    assert httpx.get(f"{url}/{done['id']}", timeout=10).json()["usage"] == done["usage"]
    # DELETE removes it where it lives; then the id is unknown, as on a single server.
    assert httpx.delete(f"{url}/{stored['id']}", timeout=10).json()["deleted"] is True
    gone = httpx.get(f"{url}/{stored['id']}", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    orphan = httpx.post(url, timeout=60, json={"input": "x", "previous_response_id": stored["id"]})
    assert orphan.status_code == 404 and orphan.json()["error"]["code"] == "previous_response_not_found"


def test_rerank_and_score_answer_as_one_engine(front, engine):
    documents = ["The dog ran in the park.", "Mom baked a cake.", "The cat slept."]
    want = engine.score("Where did the dog run?", documents, score_format=SCORE_FORMAT, use_tqdm=False)
    for path in ("/rerank", "/v2/rerank"):
        answer = httpx.post(front.base_url + path, timeout=60,
                            json={"query": "Where did the dog run?", "documents": documents})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert sorted(r["index"] for r in results) == [0, 1, 2]
        ranked = [r["relevance_score"] for r in results]
        assert ranked == sorted(ranked, reverse=True)
        for r in results:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
            assert r["document"]["text"] == documents[r["index"]]
    scores = httpx.post(front.base_url + "/score", timeout=60,
                        json={"text_1": "Where did the dog run?", "text_2": documents}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-5)


def test_each_replica_runs_on_its_own_cores(front):
    shares = []
    for index, replica in enumerate(_health(front)["replicas"]):
        status = Path(f"/proc/{_pid_of(front, index)}/status").read_text()
        allowed = parse_cpu_list(re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M)[1])
        assert set(allowed) == set(replica["cpus"]) and allowed
        shares.append(set(allowed))
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == os.sched_getaffinity(0)  # every core, each to one replica


def _read_stream(response: httpx.Response, out: dict) -> None:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    out["events"] = events


def _health_until_restarted(front, victim: int) -> list[str]:
    """The front end's health status, polled until it is "ok" after "degraded" (or 180 s)."""
    seen, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:
        health = httpx.get(f"{front.base_url}/health", timeout=10)
        assert health.status_code == 200
        seen.append(health.json()["status"])
        if seen[-1] == "degraded":  # meanwhile the other replica takes every request
            assert _complete(front, SYSTEM["a"] + USERS[0]) != victim
        if seen[-1] == "ok" and "degraded" in seen:
            break
        time.sleep(0.1)
    return seen


def test_killed_replica_fails_only_its_requests_and_restarts(front):
    long = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    with (httpx.stream("POST", f"{front.base_url}/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time", **long}) as doomed,
          httpx.stream("POST", f"{front.base_url}/v1/completions", timeout=120,
                       json={"prompt": "Tom and Mia went", **long}) as survivor):
        victim = int(doomed.headers["x-travelator-replica"])
        assert int(survivor.headers["x-travelator-replica"]) != victim
        os.kill(_pid_of(front, victim), signal.SIGKILL)
        doomed_out, survivor_out = {}, {}
        reader = threading.Thread(target=_read_stream, args=(survivor, survivor_out))
        reader.start()
        _read_stream(doomed, doomed_out)
        # Watched from the doomed stream's end, while the survivor still streams: a replica
        # restarts within seconds, before the survivor's 1500 tokens are out.
        seen = _health_until_restarted(front, victim)
        reader.join()
    assert json.loads(doomed_out["events"][-1])["error"]["code"] == "replica_failed"
    assert survivor_out["events"][-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in survivor_out["events"][:-1]
              if json.loads(e)["choices"]]
    assert finish[-1] == "length"
    assert "degraded" in seen and seen[-1] == "ok", seen
    assert _health(front)["replicas"][victim]["restarts"] == 1
    text = httpx.get(f"{front.base_url}/metrics", timeout=10).text
    assert f'travelator_replica_restarts_total{{replica="{victim}"}} 1.0' in text
    # The restarted replica serves again: two requests at once reach both replicas.
    with httpx.stream("POST", f"{front.base_url}/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", **long, "max_tokens": 300}) as held:
        first = int(held.headers["x-travelator-replica"])
        assert {first, _complete(front, "The cat sat on the mat.")} == {0, 1}
        for _ in held.iter_lines():
            pass


def test_loads_list_each_replica_as_a_rank(front):
    loads = httpx.get(f"{front.base_url}/v1/loads", timeout=10).json()["loads"]
    assert [load["dp_rank"] for load in loads] == [0, 1]
    for load, replica in zip(loads, _health(front)["replicas"]):
        text = httpx.get(f"{replica['url']}/metrics", timeout=10).text
        blocks = float(re.search(r"^travelator_kv_cache_total_blocks\{[^}]*\} (\S+)$", text, re.M)[1])
        assert load["max_total_num_tokens"] == blocks * 16  # the default block size
        assert load["num_running_reqs"] == 0


def test_a_replica_that_cannot_start_fails_the_front_end(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc = subprocess.run(serve_command(["--model", str(missing), "--data-parallel-size", "2"], free_port()),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "before it was ready" in proc.stderr and str(missing) in proc.stderr
