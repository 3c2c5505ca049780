"""The real ``vllm-router --policy kv_aware`` in front of two travelator servers that publish KV
events: it reads their events and sends a repeated prefix to the replica that holds it.

Each replica first serves half of the prompts directly; then every prompt goes through the
router, which must credit the cached prefix to the replica that holds it (its own log names the
worker and the tokens credited), and that replica must serve the prefix from its cache
(``usage.prompt_tokens_details.cached_tokens``). Blind to the events, a router would send about
half of them to the replica that never saw the prompt. Every answer equals the direct one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from paths import STORIES, needs_stories
from travelator.server.process import ServerProcess, free_port, serve_command

# Beside the interpreter (the test extra installs it into the venv), or on PATH.
ROUTER = shutil.which("vllm-router", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
pytestmark = [needs_stories, pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed")]

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
PROMPT_LEN = 50  # 3 full blocks of 16: 48 tokens the second request can find cached


def prompts() -> list[list[int]]:
    """Token-id prompts (the router hashes token ids; with text it would need the tokenizer),
    each with its own first block."""
    return [[100 + 7 * p + i % 40 for i in range(PROMPT_LEN)] for p in range(6)]


def start_replica(tmp: Path, name: str) -> tuple[ServerProcess, str, str]:
    port, events, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}"}
    args = ["--model", str(STORIES), "--dtype", "float32", "--kernels", "torch",
            "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "128", "--kv-events-config", json.dumps(config)]
    server = ServerProcess(serve_command(args, port), port, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT,
                           log_path=tmp / f"{name}.log")
    server.start(timeout=120)
    return server, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"


def start_router(tmp: Path, replicas: list[tuple[ServerProcess, str, str]]) -> ServerProcess:
    port = free_port()
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
            "--worker-urls", *(r.base_url for r, _, _ in replicas),
            "--kv-event-model", str(STORIES), "--kv-event-block-size", str(BLOCK_SIZE),
            "--prometheus-port", str(free_port()), "--log-level", "debug"]
    for server, events, replay in replicas:
        argv += ["--kv-event-source", f"{server.base_url}={events}",
                 "--kv-event-replay-source", f"{server.base_url}={replay}"]
    router = ServerProcess(argv, port, cwd=ROOT, log_path=tmp / "router.log")
    router.start(timeout=60)
    return router


def complete(base_url: str, prompt: list[int]) -> dict:
    body = {"model": str(STORIES), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def decisions(log: str) -> list[tuple[str, int]]:
    """(worker, credited prefix tokens) of each kv_aware decision in the router's log."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    return [(m["worker"], int(m["credited"])) for m in re.finditer(
        r'KV prefix decision .*?worker="(?P<worker>[^"]+)".*?credited_prefix_tokens=(?P<credited>\d+)', plain)]


def test_vllm_router_sends_a_repeated_prefix_where_it_is_cached(tmp_path):
    replicas, router = [], None
    try:
        replicas = [start_replica(tmp_path, f"replica{i}") for i in range(2)]
        router = start_router(tmp_path, replicas)
        # Each replica first serves its own half of the prompts, directly.
        home = {i: replicas[i % 2][0].base_url for i in range(len(prompts()))}
        direct = {i: complete(home[i], p)["choices"][0]["text"] for i, p in enumerate(prompts())}
        time.sleep(1.0)  # the events reach the router (same host: well within this)
        routed = [complete(router.base_url, p) for p in prompts()]
        chosen = decisions(router.log_path.read_text())
        assert len(chosen) == len(prompts()), chosen
        for i, (answer, (worker, credited)) in enumerate(zip(routed, chosen)):
            assert answer["choices"][0]["text"] == direct[i], f"prompt {i}: a wrong answer"
            assert (worker, credited) == (home[i], 48), f"prompt {i} was not sent where it is cached"
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 48, f"prompt {i}"
    finally:
        for process in [router, *(r for r, _, _ in replicas)]:
            if process is not None:
                process.close()
