"""`travelator serve` as a real process: default model, bounded waiting queue, graceful SIGTERM.

One server process for the module, started with one running slot and one waiting slot so the
queue limit is easy to reach; the last test stops it with SIGTERM.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paths import STORIES, needs_stories
from travelator.server.process import ServerProcess, free_port, serve_command

pytestmark = needs_stories

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 0.5


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    env = {"TRAVELATOR_MODEL": str(STORIES), "OMP_NUM_THREADS": "1"}
    args = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "1", "--max-waiting", "1",
            "--shutdown-grace", str(GRACE_S)]  # no --model: the built-in default, announced
    server = ServerProcess(serve_command(args, port), port, env=env, cwd=ROOT, log_path=log_path)
    try:
        try:
            server.start(timeout=120)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        yield SimpleNamespace(proc=server.proc, url=server.base_url, log=log_path)
    finally:
        server.close()


def test_default_model_is_announced(served):
    log = served.log.read_text()
    assert "no --model given: using the built-in default" in log
    assert "serving" in log and served.url in log
    models = httpx.get(f"{served.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [str(STORIES)]


def _long_stream(url: str, out: dict, started: threading.Event) -> None:
    lines = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith("data: {"):
                    started.set()
    except Exception as exc:  # noqa: BLE001 - recorded for the assertions
        out["error"] = repr(exc)
    out["lines"] = lines
    started.set()


def test_queue_full_then_sigterm_ends_streams_with_a_finish_reason(served):
    url = served.url
    a, b = {}, {}
    a_started, b_started = threading.Event(), threading.Event()
    ta = threading.Thread(target=_long_stream, args=(url, a, a_started))
    ta.start()
    assert a_started.wait(30)  # A runs (the only running slot)
    tb = threading.Thread(target=_long_stream, args=(url, b, b_started))
    tb.start()
    deadline = time.monotonic() + 10
    while gauge(url, "travelator_num_requests_waiting") < 1:  # B waits (the only waiting slot)
        assert time.monotonic() < deadline
        time.sleep(0.02)

    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "queue_full" and "--max-waiting" in err["message"]

    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    ta.join(20)
    tb.join(20)
    rc = served.proc.wait(20)
    elapsed = time.monotonic() - t0
    assert rc == 0, served.log.read_text()
    assert elapsed < GRACE_S + 6

    for name, res in (("running", a), ("waiting", b)):
        assert "error" not in res, (name, res)
        assert res["status"] == 200
        lines = res["lines"]
        assert lines[-1] == "data: [DONE]", (name, lines[-3:])
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort", (name, last)
    texts = ["".join(json.loads(x[6:])["choices"][0]["text"] for x in res["lines"][:-1]) for res in (a, b)]
    assert texts[0].startswith(", there was a little girl")  # A ran until the grace period ended
    assert texts[1] == ""  # B never got a slot
