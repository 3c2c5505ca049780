"""Data-parallel replicas against one engine, and external routers' policies against each other.

    python benchmarks/replicas.py --model dummy:llama-50m

Setups, on this machine's first two cores:

- ``1 engine x 2 cores``: one ``travelator serve`` with both cores;
- ``dp=2 front end``: ``travelator serve --data-parallel-size 2`` (one core per replica, its
  own prefix-aware routing);
- ``vllm-router cache_aware`` and ``vllm-router round_robin`` (and the same with ``smg`` when
  ``--smg`` is given): two ``travelator serve`` of one core each behind the router.

Workloads, every request sent at t=0 and streamed:

- ``W``: ../shared/peers/workload_w.py (64 requests of random token ids, outputs forced);
- ``shared``: 16 system prompts x 8 users (text; each system prompt about ``--system-words``
  words, shared by its 8 users), ``--shared-output`` tokens forced.

Per setup and workload: output tokens per second, time to first token p50/p99, and the prefix
cache hit rate (prompt tokens found cached over prompt tokens looked up, summed over every
engine). A markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

from travelator.server.process import ServerProcess, free_port, serve_command

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
WORDS = ("the cat dog sun tree red big little girl boy park ball happy sad ran saw "
         "played home mom dad friend day night water bird fish box key door").split()


def workload_w() -> list[tuple[object, int]]:
    sys.path.insert(0, str(PEERS))
    from workload_w import workload_w as make

    return make()


def shared_prefix_workload(system_words: int, output: int, seed: int = 0) -> list[tuple[object, int]]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(system_words)) + ". " for _ in range(16)]
    work = [(f"{system}User {u}: {' '.join(rng.choice(WORDS) for _ in range(12))}.", output)
            for u in range(8) for system in systems]  # users interleaved across system prompts
    return work


def _server(args, port: int, cpus: frozenset[int], extra: list[str] = ()) -> ServerProcess:
    argv = serve_command(["--model", args.model, "--served-model-name", "m", *extra], port)
    return ServerProcess(argv, port, env={"OMP_NUM_THREADS": str(len(cpus))}, cwd=ROOT, cpus=cpus)


def _router(name: str, policy: str, workers: list[str], port: int) -> ServerProcess:
    bin_dir = Path(sys.executable).parent
    head = [str(bin_dir / "vllm-router")] if name == "vllm-router" else [str(bin_dir / "smg"), "launch"]
    argv = [*head, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *workers, "--prometheus-port", str(free_port())]
    return ServerProcess(argv, port)


class Setup:
    """The processes of one setup: ``front`` takes the requests, ``engines`` hold the caches."""

    def __init__(self, front: ServerProcess, engines: list[str], extra: list[ServerProcess]) -> None:
        self.front, self.engines, self.extra = front, engines, extra

    def close(self) -> None:
        for process in [self.front, *self.extra]:
            process.stop()
            process.close()


def start_setup(name: str, args, cores: list[int]) -> Setup:
    if name == "1 engine x 2 cores":
        port = free_port()
        front = _server(args, port, frozenset(cores))
        front.start(600)
        return Setup(front, [front.base_url], [])
    if name == "dp=2 front end":
        port = free_port()
        front = _server(args, port, frozenset(cores), ["--data-parallel-size", "2"])
        front.start(600)
        urls = [r["url"] for r in httpx.get(f"{front.base_url}/health").json()["replicas"]]
        return Setup(front, urls, [])
    router_name, policy = name.split()
    workers = [_server(args, free_port(), frozenset({core})) for core in cores]
    for worker in workers:
        worker.start(600)
    port = free_port()
    front = _router(router_name, policy, [w.base_url for w in workers], port)
    front.launch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{front.base_url}/v1/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return Setup(front, [w.base_url for w in workers], workers)


def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    hits = queried = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for name, value in re.findall(r"^travelator_prefix_cache_(hit|queried)_tokens_total\{[^}]*\} (\S+)$",
                                      text, re.M):
            if name == "hit":
                hits += float(value)
            else:
                queried += float(value)
    return hits, queried


async def _one(client: httpx.AsyncClient, url: str, prompt, output: int, t0: float) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "ignore_eos": True,
            "temperature": 0, "stream": True}
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - t0
    return ttft


async def _run(url: str, work) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(_one(client, url, p, o, t0) for p, o in work))
        return time.perf_counter() - t0, ttfts


def measure(setup: Setup, work) -> dict:
    before = _prefix_counters(setup.engines)
    seconds, ttfts = asyncio.run(_run(setup.front.base_url, work))
    after = _prefix_counters(setup.engines)
    queried = after[1] - before[1]
    ttfts.sort()
    return {"tok_s": sum(o for _, o in work) / seconds, "p50": statistics.median(ttfts),
            "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "hit": (after[0] - before[0]) / queried if queried else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--shared-output", type=int, default=32)
    ap.add_argument("--smg", action="store_true", help="also smg's cache_aware and round_robin")
    ap.add_argument("--workloads", nargs="+", default=["W", "shared"], choices=["W", "shared"])
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    setups = ["1 engine x 2 cores", "dp=2 front end", "vllm-router cache_aware", "vllm-router round_robin"]
    if args.smg and shutil.which(str(Path(sys.executable).parent / "smg")):
        setups += ["smg cache_aware", "smg round_robin"]
    workloads = {"W": workload_w, "shared": lambda: shared_prefix_workload(args.system_words, args.shared_output)}
    print(f"model {args.model}, cores {cores}\n")
    print("| setup | workload | output tok/s | TTFT p50 (s) | TTFT p99 (s) | prefix hit rate |")
    print("|---|---|---|---|---|---|")
    for name in setups:
        setup = start_setup(name, args, cores)
        try:
            for workload in args.workloads:
                r = measure(setup, workloads[workload]())
                print(f"| {name} | {workload} | {r['tok_s']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | "
                      f"{r['hit']:.1%} |", flush=True)
        finally:
            setup.close()


if __name__ == "__main__":
    main()
