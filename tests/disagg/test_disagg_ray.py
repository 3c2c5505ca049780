"""``serve --disaggregate 1:1 --distributed-executor-backend ray`` across two hosts: two
network namespaces joined by a veth pair, a Ray head node (1 CPU) with the front end on the
first, a Ray worker node (1 CPU) on the second. The placement group has a 1-CPU bundle per
worker, so one worker must run on the second host: the client, on the first, gets the single
engine's greedy text and the KV crossed the link. Then the actor of the worker on the second
host is killed: its request fails instead of hanging, the server stops (no worker of that role
is left) and leaves no actor or group behind. One server serves both tests: its start is most
of their time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from paths import STORIES, needs_stories
from ray_cluster import address, ray_cluster
from travelator import LLM, SamplingParams
from travelator.disagg.frontend import DisaggConfig, DisaggregatedFrontEnd
from travelator.engine.ray_placement import RayPlacementError
from travelator.engine_args import engine_config
from two_hosts import WAIT_FOR_SERVER, Host

pytest.importorskip("ray", reason="Ray is not installed (the test extra has it)")

ENGINE = dict(device="cpu", dtype="float32", batch_invariant=True, block_size=8)
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 10
PROMPTS = ["Once upon a time", "The little dog", LONG]
MAX_TOKENS = 16
PORT = 8000
SERVE = ["serve", "--model", str(STORIES), "--device", "cpu", "--dtype", "float32", "--batch-invariant",
         "--block-size", "8", "--num-kv-blocks", "64", "--worker-threads", "1", "--port", str(PORT),
         "--disaggregate", "1:1", "--distributed-executor-backend", "ray", "--enable-debug-endpoints"]
PLACED = re.compile(r"the (\w+ worker \d+) on Ray node ([\d.]+) \(actor pid (\d+)\)")
RELEASED = "killed 2 Ray actors and removed their placement group"
# Run on the first host: wait for the server, send each prompt counting the bytes that cross
# the link meanwhile, read the decode side's KV figure and the workers' pids, print them all;
# then, on a line from stdin, send one more request and print what came back.
CLIENT = WAIT_FOR_SERVER + """
import json, sys, time, httpx
url, prompts, max_tokens, stats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def link_bytes():
    return sum(int(open(f"{stats}/{name}").read()) for name in ("rx_bytes", "tx_bytes"))
wait_for(url)
before = link_bytes()
answers = [httpx.post(url + "/v1/completions", timeout=120, json={"prompt": p, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": True}).json() for p in prompts]
crossed = link_bytes() - before
time.sleep(0.5)  # the workers' figures at rest
metrics = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("travelator_disagg_kv")]
workers = httpx.get(url + "/debug/engine", timeout=30).json()["workers"]
print(json.dumps({"answers": answers, "metrics": metrics, "crossed": crossed, "workers": workers}), flush=True)
sys.stdin.readline()
r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "Once upon a time", "max_tokens": 8})
print(json.dumps({"status": r.status_code, "body": r.text}), flush=True)
"""
# Run on the first host: once the cluster has settled, its placement groups not removed and its CPUs.
CLUSTER_STATE = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 15
while True:
    live = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
    if (not live and free == total) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({"live_groups": len(live), "free_cpus": free, "cpus": total}))
"""
# Run on the first host: place the workers of --disaggregate 2:1 as the front end does.
PLACE_2_1 = """
import logging, sys
from travelator.disagg import messages as m
from travelator.disagg.ray_workers import RayWorkers
from travelator.engine.ray_placement import RayPlacementError
logging.disable(logging.WARNING)
try:
    RayWorkers([m.WorkerId(m.PREFILL, 0), m.WorkerId(m.PREFILL, 1), m.WorkerId(m.DECODE, 0)], 1, timeout_s=1)
except RayPlacementError as exc:
    print(exc)
"""


def test_without_a_cluster_the_front_end_says_what_to_do(monkeypatch):
    # First in the module: Ray's "auto" also finds a cluster by its processes, such as this module's.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = engine_config(str(STORIES), device="cpu", distributed_executor_backend="ray")
    with pytest.raises(RayPlacementError, match="no Ray cluster to join at 'auto'.*ray start --head"):
        DisaggregatedFrontEnd(config, DisaggConfig(1, 1))
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    with pytest.raises(RayPlacementError, match="needs Ray"):
        DisaggregatedFrontEnd(config, DisaggConfig(1, 1))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Host, Host]]:
    """A Ray cluster of two 1-CPU nodes, one per host. Its raylets leave a dead actor's child
    processes be (by default they kill them, and a worker's connection closes with it), so that
    a worker outliving its actor is seen by the front end's watch on the actors alone."""
    keep_children = {"RAY_kill_child_processes_on_worker_exit": "0", "RAY_process_group_cleanup_enabled": "0"}
    with ray_cluster(cpus=1, env=keep_children) as hosts:
        yield hosts


@dataclass
class Served:
    """The server on the first host, its client, and what the client saw of the prompts."""

    server: subprocess.Popen
    client: subprocess.Popen
    log: Path
    seen: dict

    def placed(self) -> dict[str, tuple[str, int]]:
        """Each worker's node and actor pid, as the front end logged them."""
        return {w: (ip, int(pid)) for w, ip, pid in PLACED.findall(self.log.read_text())}


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory) -> Iterator[Served]:
    """One server for the module's two tests (its start is most of their time): the first
    checks what it served, the second kills a worker's actor, which ends it."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not found")
    first, _ = cluster
    log = tmp_path_factory.mktemp("disagg_ray") / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            first.command([sys.executable, "-m", "travelator.cli", "--log-level", "INFO", *SERVE, "--host",
                           first.address], env={"RAY_ADDRESS": address(first), "OMP_NUM_THREADS": "1"}),
            stdout=out, stderr=subprocess.STDOUT)
    client = subprocess.Popen(first.command([sys.executable, "-c", CLIENT, f"http://{first.address}:{PORT}",
                                             json.dumps(PROMPTS), str(MAX_TOKENS),
                                             f"/sys/class/net/{first.interface}/statistics"]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline()
        assert line, client.stderr.read()[-2000:] + log.read_text()[-3000:]
        yield Served(server, client, log, json.loads(line))
    finally:
        for proc in (client, server):
            proc.kill()
            proc.wait()


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (a zombie has) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _metric(metrics: list[str], prefix: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics if ln.startswith(prefix))


@needs_stories
def test_a_worker_placed_on_the_other_host_gives_the_single_engines_text(cluster, served):
    first, second = cluster
    llm = LLM(str(STORIES), **ENGINE, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [r.outputs[0].text for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    arch = llm.engine.arch
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # float32 K and V
    placed = served.placed()
    assert sorted(placed) == ["decode worker 0", "prefill worker 0"]
    assert {ip for ip, _ in placed.values()} == {first.address, second.address}  # a bundle per node
    seen = served.seen
    assert [a["choices"][0]["text"] for a in seen["answers"]] == expected
    # Every prompt's KV went to the decode worker, over the link between the hosts.
    moved = _metric(seen["metrics"], 'travelator_disagg_kv_transfer_bytes_total{index="0",role="decode"}')
    assert moved >= sum(a["usage"]["prompt_tokens"] for a in seen["answers"]) * kv_bytes_per_token
    assert seen["crossed"] > moved


@needs_stories
def test_a_killed_worker_actor_fails_its_request_and_the_server_leaves_nothing(cluster, served):
    first, second = cluster
    (name, (_, actor_pid)), = [(w, p) for w, p in served.placed().items() if p[0] == second.address]
    # Its worker process holds still, so the request waits there, and outlives its actor:
    # only Ray can tell the front end that the actor died.
    stopped = served.seen["workers"][name]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        served.client.stdin.write("go\n")
        served.client.stdin.flush()
        time.sleep(1.0)  # the request reaches the stopped worker
        os.kill(actor_pid, signal.SIGKILL)
        t0 = time.monotonic()
        answer = json.loads(served.client.stdout.readline() or "{}")
        took = time.monotonic() - t0
        served.server.wait(timeout=60)  # no worker of that role is left: the server stops
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)  # it finds its actor gone and exits
    out = served.log.read_text()
    assert answer.get("status") == 500 and f"the {name} died" in answer["body"], (answer, out[-3000:])
    assert took < 10
    assert f"its Ray actor on {second.address} ended" in out
    assert served.server.returncode == 1, out[-3000:]
    # It stopped the other worker, killed the actors and removed the group; nothing is left.
    assert RELEASED in out
    assert all(_gone(pid) for _, pid in served.placed().values()) and _gone(stopped)
    state = subprocess.run(first.command([sys.executable, "-c", CLUSTER_STATE, address(first)]),
                           capture_output=True, text=True, timeout=120)
    assert json.loads(state.stdout) == {"live_groups": 0, "free_cpus": 2.0, "cpus": 2.0}, state.stderr[-2000:]


@needs_stories
def test_a_group_the_cluster_cannot_hold_fails_in_time_saying_what_is_missing(cluster):
    first, _ = cluster
    # Three 1-CPU workers on two 1-CPU nodes: the group can never be granted.
    placing = subprocess.run(first.command([sys.executable, "-c", PLACE_2_1], env={"RAY_ADDRESS": address(first)}),
                             capture_output=True, text=True, timeout=120)
    assert "the Ray cluster did not grant the placement group within 1 s: 3 bundles of 1 CPU(s), one per " \
           "worker, 3 CPUs in all; the cluster has 2 CPUs" in placing.stdout, placing.stderr[-3000:]
    assert "add nodes or CPUs, or lower --worker-threads" in placing.stdout
