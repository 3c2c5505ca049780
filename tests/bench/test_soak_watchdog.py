"""The watchdog, by injected faults: a failed step, a dead step loop, a stuck step.

- A model run that raises fails the requests of that step with a clear error (a 500 JSON body, or
  an error event that ends the stream) and the engine goes on serving the others.
- A step loop that dies fails every waiting client at once, /health turns 503, new requests get
  503, and `travelator serve` exits non-zero instead of hanging.
- A step that runs past ``step_timeout_s`` turns /health 503, and `travelator serve` fails its
  clients and exits non-zero.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from paths import STORIES, needs_stories
from live import serve_in_thread
from travelator import LLM
from travelator.engine import sampling_stage
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.process import ServerProcess, free_port
from travelator.server.settings import ServerSettings

pytestmark = needs_stories

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"


@contextlib.contextmanager
def live_server(llm: LLM, **settings):
    """uvicorn in a thread on a free port of 127.0.0.1; yields (client, async_engine)."""
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, ServerSettings(enable_debug_endpoints=True, **settings))
    with serve_in_thread(app, name="watchdog-uvicorn") as url:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, connect=5)) as http:
            yield http, async_engine


def sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def long_body(**extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, **extra}


def wait_until(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def fault_in_model_run(monkeypatch) -> dict:
    """Make the sampling of the next ``armed`` steps raise: the runner has applied the step's
    changes and run the model, then fails (as a kernel or sampler error would)."""
    state = {"armed": 0, "raised": 0}
    sample = sampling_stage.sample

    def faulty(*args, **kwargs):
        if state["armed"]:
            state["armed"] -= 1
            state["raised"] += 1
            raise RuntimeError("injected fault in the model run")
        return sample(*args, **kwargs)

    monkeypatch.setattr(sampling_stage, "sample", faulty)
    return state


def fault_in_execute(monkeypatch, runner) -> dict:
    """Make the runner's ``execute`` raise at once for the next ``armed`` non-empty steps."""
    state = {"armed": 0, "raised": 0}
    execute = runner.execute

    def faulty(out):
        if state["armed"] and not out.is_empty:
            state["armed"] -= 1
            state["raised"] += 1
            raise RuntimeError("injected fault in execute")
        return execute(out)

    monkeypatch.setattr(runner, "execute", faulty)
    return state


# ---------------------------------------------------------------------------- a failed step


def test_failed_step_fails_its_requests_and_the_server_goes_on(monkeypatch):
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=1)
    fault = fault_in_model_run(monkeypatch)
    with live_server(llm) as (http, async_engine):
        def idle() -> bool:
            return async_engine.num_in_flight == 0 and not llm.engine.has_unfinished_requests()

        # Non-streaming, n=1 and n=2: a 500 with an OpenAI error body that says what happened.
        for n in (1, 2):
            wait_until(idle, what="idle")
            fault["armed"] = 1
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": n})
            assert time.monotonic() - t0 < 10
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "engine_error" and "injected fault" in err["message"]
        # Streaming: an error event, then the end of the stream.
        wait_until(idle, what="idle")
        fault["armed"] = 1
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 5, "stream": True})
        assert r.status_code == 200
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_error" and "injected fault" in err["message"]

        # One running slot: A runs, B waits. A step fails: A (in it) gets the error, B (not in it)
        # is served in full afterwards.
        results = {}
        wait_until(idle, what="idle")

        def run(name, body):
            results[name] = http.post("/v1/completions", json=body)

        ta = threading.Thread(target=run, args=("a", long_body()))
        ta.start()
        wait_until(lambda: llm.engine.num_running == 1, what="A running")
        tb = threading.Thread(target=run, args=("b", {"prompt": "Lily and Ben", "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}))
        tb.start()
        wait_until(lambda: llm.engine.num_waiting == 1, what="B waiting")
        fault["armed"] = 1
        ta.join(30)
        tb.join(30)
        assert results["a"].status_code == 500 and results["a"].json()["error"]["code"] == "engine_error"
        b = results["b"].json()
        assert results["b"].status_code == 200 and b["choices"][0]["finish_reason"] == "length"
        assert b["usage"]["completion_tokens"] == 8
        assert fault["raised"] == 4

        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ", there was a little"
        report = http.get("/debug/engine").json()
        assert report["ok"] and report["idle"], (report["problems"], report)
        assert report["kv"]["used_blocks"] == 0
        # n=1, the first choice of n=2 (one running slot: its second is aborted with it), chat, A.
        assert report["counters"]["finished"]["error"] == 4
        assert async_engine.healthy


def test_execute_failing_at_once_leaves_no_runner_state(monkeypatch):
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=64, max_model_len=256)
    fault = fault_in_execute(monkeypatch, llm.engine.runner)
    with live_server(llm) as (http, async_engine):
        # R1 finishes; the runner learns so in the next step's output, which fails at once.
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).status_code == 200
        fault["armed"] = 1
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 500 and "injected fault in execute" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).status_code == 200
        report = http.get("/debug/engine").json()
        assert report["kv"]["used_blocks"] == 0  # the KV blocks are all back: only runner state is left
        assert report["ok"], report["problems"]


# ---------------------------------------------------------------------------- a dead loop


def test_dead_step_loop_fails_clients_and_health_turns_503(monkeypatch):
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=64, max_model_len=256)
    with live_server(llm) as (http, async_engine):
        deaths = []
        async_engine.death_listeners.append(deaths.append)
        results = {}

        def stream():
            with http.stream("POST", "/v1/completions", json=long_body(stream=True, max_tokens=240)) as r:
                results["stream_status"] = r.status_code
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            started.set()
                results["stream"] = events

        def plain():
            results["plain"] = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": True})

        started = threading.Event()
        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(20)
        wait_until(lambda: llm.engine.num_running == 2, what="both running")

        def broken_schedule():
            raise RuntimeError("injected: the scheduler broke")

        t0 = time.monotonic()
        monkeypatch.setattr(llm.engine.scheduler, "schedule", broken_schedule)
        for t in threads:
            t.join(20)
            assert not t.is_alive(), "a client hangs after the step loop died"
        assert time.monotonic() - t0 < 10

        events = results["stream"]
        assert results["stream_status"] == 200 and events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead" and "scheduler broke" in err["message"]
        r = results["plain"]
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"

        assert len(deaths) == 1 and "scheduler broke" in str(deaths[0])
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "travelator_engine_healthy{" in http.get("/metrics").text
        assert any(line.startswith("travelator_engine_healthy{") and line.endswith(" 0.0")
                   for line in http.get("/metrics").text.splitlines())
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        # The self-check still answers (the engine is at rest now) and says the loop is dead.
        report = http.get("/debug/engine").json()
        assert report["healthy"] is False and "scheduler broke" in report["error"]
        assert report["streams"] == 0


# ---------------------------------------------------------------------------- a stuck step


def test_a_step_past_the_timeout_turns_health_503(monkeypatch):
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=64, max_model_len=256)
    runner = llm.engine.runner
    execute = runner.execute
    slow = {"once": True}

    def sometimes_slow(out):
        if slow["once"] and not out.is_empty:
            slow["once"] = False
            time.sleep(2.0)
        return execute(out)

    monkeypatch.setattr(runner, "execute", sometimes_slow)
    with live_server(llm, step_timeout_s=0.5) as (http, async_engine):
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})))
        t.start()
        wait_until(lambda: async_engine.step_running_for() > 0.7, what="a long step")
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stuck"
        t.join(20)
        assert done["r"].status_code == 200  # the step did end: in-process nobody gave up on it
        assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------- the process


_FAULTY_SERVE = """
import sys, time
from travelator.engine import engine as E

def step(self):
    if sys.argv[1] == "raise":
        raise RuntimeError("injected: the step loop dies")
    time.sleep(120)  # a step that never ends

E.LLMEngine.step = step
from travelator.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("mode", ["raise", "stuck"])
def test_serve_exits_nonzero_when_the_step_loop_is_lost(tmp_path, mode):
    port = free_port()
    env = {"OMP_NUM_THREADS": "1"}
    if mode == "stuck":
        env["TRAVELATOR_STEP_TIMEOUT_S"] = "1"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", _FAULTY_SERVE, mode, "serve", "--model", str(STORIES), "--dtype", "float32",
           "--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "256", "--shutdown-grace", "1"]
    server = ServerProcess(cmd, port, env=env, cwd=ROOT, log_path=log_path)
    try:
        server.start(timeout=120)
        t0 = time.monotonic()
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5},
                       timeout=30)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        assert ("the step loop dies" if mode == "raise" else "step_timeout_s") in r.json()["error"]["message"]
        rc = server.proc.wait(30)
        assert rc == 1, log_path.read_text()
        assert time.monotonic() - t0 < 20
        assert "shutting the server down" in log_path.read_text()
    finally:
        server.close()
