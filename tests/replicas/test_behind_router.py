"""Two travelator servers behind the real ``vllm-router`` and ``smg`` binaries (started here):
mixed shared-prefix traffic through the router answers as one engine does, the cache-aware
policy finds more of the prompts in the servers' prefix caches than round robin, and a killed
server is taken out of rotation while requests keep succeeding."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from paths import STORIES, needs_stories
from travelator import LLM, SamplingParams
from travelator.server.process import ServerProcess, free_port, serve_command

pytestmark = needs_stories
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

SYSTEMS = [
    "Once upon a time there was a little dog named Max. Max liked to run in the big green park "
    "with his friend Tom. Every day they played with a red ball near the old tree. ",
    "One day a girl named Sue found a shiny box under her bed. She wanted to open it, but it was "
    "locked. She asked her mom for help and they looked for the key together. ",
    "There was a big bear who lived in the woods. He was very hungry and wanted to find some "
    "honey. He walked and walked until he saw a tall tree with bees around it. ",
]
USERS = ["He was happy.", "It was cold.", "Then it rained.", "She smiled."]
MAX_TOKENS = 12


def _vllm_router(port: int, workers: list[str], policy: str) -> list[str]:
    return [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *workers, "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


def _smg(port: int, workers: list[str], policy: str) -> list[str]:
    return [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
            policy, "--worker-urls", *workers, "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


ROUTERS = {"vllm-router": _vllm_router, "smg": _smg}


def _traffic(tag: str) -> list[str]:
    """Three system prompts' users interleaved: each prefix comes back every third request,
    so round robin over two servers sends it to both."""
    return [f"{tag} {system}{user}" for user in USERS for system in SYSTEMS]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("workers")
    started = []
    try:
        for index, cpu in enumerate(sorted(os.sched_getaffinity(0))[:2]):
            port = free_port()
            args = ["--model", str(STORIES), "--dtype", "float32", "--served-model-name", "m"]
            server = ServerProcess(serve_command(args, port), port, env={"OMP_NUM_THREADS": "1"},
                                   cwd=ROOT, log_path=logs / f"worker-{index}.log", cpus=frozenset({cpu}))
            started.append(server)
            server.start(timeout=300)
        yield started
    finally:
        for server in started:
            server.stop()
            server.close()


@pytest.fixture(scope="module")
def reference():
    """One engine's greedy answers."""
    engine = LLM(str(STORIES), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def answers(prompts: list[str]) -> list[str]:
        return [r.outputs[0].text for r in engine.generate(prompts, params, use_tqdm=False)]

    return answers


class Router:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = ServerProcess(argv, port, log_path=log)

    def __enter__(self) -> Router:
        self.process.launch()
        deadline = time.monotonic() + 60
        while True:  # ready once it routes a request
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start:\n{self.process.log_tail()}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.process.stop(10)
        self.process.close()

    def complete(self, prompt: str) -> str:
        r = httpx.post(f"{self.url}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def _counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(m[1]) for m in re.finditer(rf"^travelator_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def _hit_rate(servers, run) -> float:
    """The fraction of prompt tokens found cached, over every server, while ``run()`` runs."""
    before = [(_counter(s, "prefix_cache_hit_tokens"), _counter(s, "prefix_cache_queried_tokens")) for s in servers]
    run()
    hits = sum(_counter(s, "prefix_cache_hit_tokens") - b[0] for s, b in zip(servers, before))
    queried = sum(_counter(s, "prefix_cache_queried_tokens") - b[1] for s, b in zip(servers, before))
    return hits / queried


@pytest.mark.parametrize("router_name", list(ROUTERS))
def test_cache_aware_routing_beats_round_robin(router_name, servers, reference, tmp_path):
    if shutil.which(str(BIN / router_name)) is None:
        pytest.skip(f"{router_name} is not installed (the test extra installs it)")
    workers = [s.base_url for s in servers]
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        prompts = _traffic(f"[{router_name} {policy}]")
        expected = reference(prompts)
        port = free_port()
        with Router(ROUTERS[router_name](port, workers, policy), port, tmp_path / f"{policy}.log") as router:
            def run():
                answers = [router.complete(p) for p in prompts]
                assert answers == expected  # every answer as one engine gives it
            rates[policy] = _hit_rate(servers, run)
    assert rates["cache_aware"] > rates["round_robin"], rates


# vllm-router only: smg's health checks take the same path, and the suite's time is bounded.
@pytest.mark.parametrize("router_name", ["vllm-router"])
def test_a_killed_server_leaves_the_rotation(router_name, reference, tmp_path):
    if shutil.which(str(BIN / router_name)) is None:
        pytest.skip(f"{router_name} is not installed (the test extra installs it)")
    ports = [free_port(), free_port()]
    servers = [ServerProcess(serve_command(["--model", str(STORIES), "--dtype", "float32",
                                            "--served-model-name", "m"], p), p,
                             env={"OMP_NUM_THREADS": "1"}, cwd=ROOT, log_path=tmp_path / f"w{p}.log")
               for p in ports]
    try:
        for server in servers:
            server.start(timeout=300)
        prompts = _traffic(f"[{router_name} kill]")
        expected = reference(prompts)
        port = free_port()
        with Router(ROUTERS[router_name](port, [s.base_url for s in servers], "round_robin"), port,
                    tmp_path / "router.log") as router:
            assert [router.complete(p) for p in prompts[:4]] == expected[:4]
            survivor_before = _counter(servers[0], "request_success")
            servers[1].proc.send_signal(signal.SIGKILL)
            servers[1].proc.wait()
            # Every request still succeeds, and from now on only the survivor answers.
            assert [router.complete(p) for p in prompts[4:]] == expected[4:]
            assert _counter(servers[0], "request_success") - survivor_before == len(prompts) - 4
    finally:
        for server in servers:
            server.stop()
            server.close()


def _gauge(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return float(re.search(rf"^travelator_{name}\{{[^}}]*\}} (\S+)$", text, re.M)[1])


def test_smg_reads_each_servers_load(servers, tmp_path):
    """smg's load monitor polls /v1/loads: what it shows is the servers' KV pool in tokens
    (blocks x 16, the block size) and their running requests."""
    port = free_port()
    argv = _smg(port, [s.base_url for s in servers], "cache_aware") + ["--load-monitor-interval", "1"]
    with Router(argv, port, tmp_path / "smg.log") as router:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                "temperature": 0, "stream": True}
        busy = servers[0]  # a request held there, sent past the router: the load is the server's own
        with httpx.stream("POST", f"{busy.base_url}/v1/completions", json=body, timeout=120) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            expected = {servers[0].base_url: 1, servers[1].base_url: 0}
            deadline, running = time.monotonic() + 8, {}
            while time.monotonic() < deadline and running != expected:
                loads = httpx.get(f"{router.url}/get_loads", timeout=10).json()["loads"]
                running = {load["worker"]: load["num_running_reqs"] for load in loads}
                time.sleep(0.2)
            assert running == expected, loads
            assert _gauge(busy, "num_requests_running") == 1
        for load in loads:
            server = next(s for s in servers if s.base_url == load["worker"])
            assert load["max_total_num_tokens"] == _gauge(server, "kv_cache_total_blocks") * 16
