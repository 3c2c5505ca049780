"""GET /dashboard and its stream /dashboard/stream on a real server (stories260K, in-process):
the records against what the clients got, resuming, the API key, and a client that opens the
stream and never reads it. The page itself, in a browser: test_dashboard_browser.py."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from live import serve_in_thread
from paths import STORIES, needs_stories

from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.process import ServerProcess, free_port, serve_command
from travelator.server.settings import ServerSettings

ENGINE = dict(dtype="float32", max_num_seqs=2, block_size=8)


def serve(**settings):
    engine = AsyncEngine(LLM(str(STORIES), **ENGINE).engine)
    return serve_in_thread(build_app(engine, ServerSettings(**settings)))


def complete(url: str, prompt: str, max_tokens: int, headers=None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, headers=headers, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def read_events(response: httpx.Response, until, timeout_s: float = 40.0) -> list[tuple[str, str]]:
    """(event, data) pairs of a server-sent event stream until ``until(events)`` holds (an
    AssertionError past ``timeout_s``: the stream's comment lines come every 15 s at rest)."""
    events, event, data = [], "message", []
    deadline = time.monotonic() + timeout_s
    for line in response.iter_lines():
        assert time.monotonic() < deadline, f"not seen in {timeout_s} s; the stream so far: {events[-3:]}"
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            events.append((event, "\n".join(data)))
            event, data = "message", []
            if until(events):
                return events
    raise AssertionError(f"the stream ended after {len(events)} events")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@needs_stories
def test_the_stream_follows_the_batch_and_resumes():
    with serve() as url:
        steps_before = metric(url, "travelator_engine_steps_total")
        with httpx.stream("GET", f"{url}/dashboard/stream", timeout=60) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            # The long one first; once it runs, the other two at the same instant: the batch
            # then fills both seats (a 260K model makes a token in under 1 ms; sent all at
            # once, a busy machine twice had one request after another finish alone; under
            # the 300 records a new stream starts back, so the oldest record is still 1).
            lengths = {"Once upon a time": 280, "The little dog": 7, "Lily and Tom": 3}
            answers = {}
            start = threading.Barrier(len(lengths) - 1)

            def send(prompt, n, wait):
                if wait:
                    start.wait()
                answers[prompt] = complete(url, prompt, n).json()

            threads = [threading.Thread(target=send, args=(*item, i > 0)) for i, item in enumerate(lengths.items())]
            threads[0].start()
            deadline = time.monotonic() + 30
            while metric(url, "travelator_num_requests_running") < 1:
                assert time.monotonic() < deadline, "the long request never ran"
                time.sleep(0.001)
            for t in threads[1:]:
                t.start()
            for t in threads:
                t.join()
            steps = metric(url, "travelator_engine_steps_total") - steps_before
            # One record per step, and one more each time the engine ran out of work.
            events = read_events(stream, lambda ev: sum(
                e == "message" and not json.loads(d)["idle"] for e, d in ev) == steps)
        info = json.loads(events[0][1])
        assert events[0][0] == "info" and info["max_num_seqs"] == 2 and info["block_size"] == 8
        records = [json.loads(d) for e, d in events if e == "message"]
        assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
        assert all(r["prompts"] == {} for r in records)  # no prompt text unless allowed
        ids = {a["id"] + "-0" for a in answers.values()}
        joined = [rid for r in records for rid in r["joined"]]
        left = {rid: why for r in records for rid, _, why in r["left"]}
        assert sorted(joined) == sorted(ids) and left == {rid: "length" for rid in ids}
        # Every token the clients got was generated in some step of the stream.
        assert sum(r["generated"] for r in records) == sum(lengths.values()) == sum(
            a["usage"]["completion_tokens"] for a in answers.values())
        assert max(len(r["seats"]) for r in records) == 2 and records[-1]["kv"]["used"] == 0
        finished = {f[0]: f for r in records for f in r["finished"]}
        assert {rid: f[4] for rid, f in finished.items()} == {
            a["id"] + "-0": a["usage"]["completion_tokens"] for a in answers.values()}
        # A reader that comes back after record 3 gets 4, 5, ...
        with httpx.stream("GET", f"{url}/dashboard/stream?after=3", timeout=60) as again:
            resumed = read_events(again, lambda ev: len(ev) >= 3)
        assert [json.loads(d)["seq"] for _, d in resumed[1:]] == [4, 5]
        # ... and an EventSource's Last-Event-ID resumes it the same way, from this server only:
        # one it kept from a server since restarted (another instance), or past the last
        # record, starts over from the oldest record of the backlog.
        instance = info["instance"]
        for last_id, first in ((f"{instance}-5", 6), ("0badc0de-5", 1), (f"{instance}-99999", 1), ("x", 1)):
            with httpx.stream("GET", f"{url}/dashboard/stream", headers={"Last-Event-ID": last_id},
                              timeout=60) as again:
                resumed = read_events(again, lambda ev: len(ev) >= 2)
            assert json.loads(resumed[1][1])["seq"] == first, last_id
        with httpx.stream("GET", f"{url}/dashboard/stream", params={"after": "\u00b2"}, timeout=60) as odd:
            assert odd.status_code == 200  # a "digit" int() refuses: read as no position at all
            assert json.loads(read_events(odd, lambda ev: len(ev) >= 2)[1][1])["seq"] == 1


@needs_stories
def test_the_dashboard_needs_the_key_when_the_server_has_one():
    with serve(api_key="sesame") as url:
        page = httpx.get(f"{url}/dashboard")
        assert page.status_code == 401 and 'name="key"' in page.text and "TRAVELATOR_REPLAY" not in page.text
        assert httpx.get(f"{url}/dashboard/stream").status_code == 401
        assert httpx.get(f"{url}/dashboard/info").status_code == 401
        wrong = httpx.post(f"{url}/dashboard/login", data={"key": "open"})
        assert wrong.status_code == 401 and "not the server" in wrong.text
        with httpx.Client(base_url=url) as browser:  # keeps the cookie, as a browser does
            ok = browser.post("/dashboard/login", data={"key": "sesame"})
            assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
            assert "sesame" not in ok.headers["set-cookie"]
            page = browser.get("/dashboard")
            assert page.status_code == 200 and "EventSource" in page.text
            assert browser.get("/dashboard/info").json()["max_num_seqs"] == 2
        bearer = {"Authorization": "Bearer sesame"}
        with httpx.stream("GET", f"{url}/dashboard/stream", headers=bearer, timeout=30) as stream:
            assert stream.status_code == 200
            assert read_events(stream, lambda ev: True)[0][0] == "info"
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the API is as closed as before
        # The login form is one field: a body past 4 KiB is refused, whether it says its
        # length or streams without one, before it is read in full.
        huge = {"key": "x" * 8192}
        assert httpx.post(f"{url}/dashboard/login", data=huge).status_code == 413
        chunks = (b"key=" + b"x" * 1024 for _ in range(64))
        too_long = httpx.post(f"{url}/dashboard/login", content=chunks,
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "request_too_large"


@needs_stories
def test_without_a_key_only_this_machine_sees_it():
    """Clients on this machine see the live view of a server without a key; others get a 403
    (here: a proxy on this machine forwarding a remote client, which uvicorn reports)."""
    remote = {"X-Forwarded-For": "203.0.113.7"}
    with serve() as url:
        assert httpx.get(f"{url}/dashboard").status_code == 200
        assert httpx.get(f"{url}/dashboard/info").status_code == 200
        for path in ("", "/stream", "/info"):
            r = httpx.get(f"{url}/dashboard{path}", headers=remote)
            assert r.status_code == 403 and r.json()["error"]["code"] == "dashboard_local_only", path
            assert "--api-key" in r.json()["error"]["message"]
        assert complete(url, "Once upon a time", 2, headers=remote).status_code == 200  # the API: open


def _network_address() -> str | None:
    """This machine's address on its default route, if it has one (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: any routed address will do
        except OSError:
            return None
        host = s.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


@needs_stories
def test_serving_the_network_without_a_key_warns_and_keeps_the_view_local(tmp_path):
    host = _network_address()
    if host is None:
        pytest.skip("this machine has no network address besides loopback")
    port = free_port(host)
    server = ServerProcess(serve_command(["--model", str(STORIES), "--dtype", "float32"], port, host), port,
                           host=host, env={"OMP_NUM_THREADS": "1"}, log_path=tmp_path / "serve.log")
    try:
        server.start(timeout=120)
        assert "the live view answers clients on this machine only" in server.log_text()
        page = httpx.get(f"{server.base_url}/dashboard")  # from this machine, but not over loopback
        assert page.status_code == 403 and page.json()["error"]["code"] == "dashboard_local_only"
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
    finally:
        server.close()


@needs_stories
def test_an_idle_record_empties_the_walkway():
    """A request done in one step: its step's record shows it joining and leaving, then one
    record says the engine is idle, with an empty batch (else a page would keep showing it)."""
    with serve() as url:
        with httpx.stream("GET", f"{url}/dashboard/stream", timeout=30) as stream:
            rid = complete(url, "Once upon a time", 1).json()["id"] + "-0"
            events = read_events(stream, lambda ev: json.loads(ev[-1][1]).get("idle", False))
        step, idle = (json.loads(d) for _, d in events[-2:])
        assert step["joined"] == [rid] and step["left"] == [[rid, 0, "length"]] and not step["idle"]
        assert idle["idle"] and idle["seats"] == [] and idle["waiting"] == 0 and idle["kv"]["used"] == 0
        assert idle["step"] == step["step"] and idle["ms"] == 0.0


@needs_stories
def test_prompt_text_only_when_allowed():
    prompt = "Lily and Tom went to the park and"
    with serve(dashboard_show_prompts=True) as url:
        with httpx.stream("GET", f"{url}/dashboard/stream", timeout=60) as stream:
            answer = complete(url, prompt + " " + "x" * 300, 2).json()  # past the 200 characters shown
            rid = answer["id"] + "-0"
            events = read_events(stream, lambda ev: any(rid in json.loads(d).get("joined", ())
                                                       for e, d in ev if e == "message"))
        joined = next(json.loads(d) for e, d in events if e == "message" and rid in json.loads(d)["joined"])
        text = joined["prompts"][rid]
        assert text.lstrip().startswith(prompt) and len(text) == 200


@needs_stories
def test_no_dashboard_when_turned_off():
    with serve(dashboard=False) as url:
        assert httpx.get(f"{url}/dashboard").status_code == 404
        assert httpx.get(f"{url}/dashboard/stream").status_code == 404
        assert complete(url, "Once upon a time", 3).status_code == 200


def _mean_step_s(url: str, prompts: list[str], n: int) -> float:
    count0, sum0 = (metric(url, f"travelator_step_duration_seconds_{k}") for k in ("count", "sum"))
    threads = [threading.Thread(target=complete, args=(url, p, n)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count1, sum1 = (metric(url, f"travelator_step_duration_seconds_{k}") for k in ("count", "sum"))
    return (sum1 - sum0) / (count1 - count0)


@needs_stories
def test_a_stalled_reader_does_not_slow_the_engine():
    """Rounds with and without a reader that opened the stream and never reads a byte (its
    socket buffers fill, then the server's writes to it wait), taken in turns: the step thread
    never waits on a reader, so the step time stays put. Steps here take a few ms (a tiny
    model), so what a step costs outside the model shows up; the bound is loose for this
    machine's noise (a step thread that waited on the reader would stop outright)."""
    prompts = ["Once upon a time", "The little dog"]
    with serve(dashboard_show_prompts=True) as url:
        _mean_step_s(url, prompts, 50)  # warm
        host, port = url.removeprefix("http://").split(":")
        alone, stalled = [], []
        for _ in range(5):
            alone.append(_mean_step_s(url, prompts, 150))
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect((host, int(port)))
            reader.sendall(b"GET /dashboard/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                stalled.append(_mean_step_s(url, prompts, 150))
                # ... and a reader that does read still gets the newest steps.
                with httpx.stream("GET", f"{url}/dashboard/stream", timeout=30) as stream:
                    events = read_events(stream, lambda ev: len(ev) >= 2)
                assert json.loads(events[1][1])["step"] > 0
            finally:
                reader.close()
        ratio = statistics.median(stalled) / statistics.median(alone)
        assert ratio < 2.0, (ratio, alone, stalled)
