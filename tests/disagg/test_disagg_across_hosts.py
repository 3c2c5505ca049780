"""``serve --disaggregate 1:1`` across two hosts under torchrun, as on two machines: two network
namespaces joined by a veth pair, node rank 0 (the front end and the prefill worker) on one,
node rank 1 (the decode worker) on the other. The client, on the first host, gets the single
engine's greedy text; the KV crossed the link; stopping the front end stops the remote worker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from paths import STORIES, needs_stories
from two_hosts import WAIT_FOR_SERVER, Host, two_hosts

from travelator import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", batch_invariant=True, block_size=8)
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 10
PROMPTS = ["Once upon a time", "The little dog", LONG]
MAX_TOKENS = 16
PORT, MASTER_PORT = 8000, 29500
SECRET = "0123456789abcdef-disagg-across-hosts"
SERVE = ["-m", "travelator.cli", "serve", "--model", str(STORIES), "--device", "cpu", "--dtype", "float32",
         "--batch-invariant", "--block-size", "8", "--num-kv-blocks", "64", "--disaggregate", "1:1",
         "--worker-threads", "1", "--port", str(PORT)]
# Run on the first host: wait for the server, send each prompt, then read the decode side's KV figure.
CLIENT = WAIT_FOR_SERVER + """
import json, sys, time, httpx
url, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
wait_for(url)
answers = [httpx.post(url + "/v1/completions", timeout=120, json={"prompt": p, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": True}).json() for p in prompts]
time.sleep(1.5)  # the workers' figures at rest
metrics = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("travelator_disagg_kv")]
print(json.dumps({"answers": answers, "metrics": metrics}))
"""


def _node(host: Host, master: Host, node_rank: int) -> list[str]:
    return host.command([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                         str(node_rank), "--nproc-per-node", "1", "--master-addr", master.address,
                         "--master-port", str(MASTER_PORT), *SERVE, "--host", host.address],
                        env={"TRAVELATOR_TP_SECRET": SECRET, "OMP_NUM_THREADS": "1"})


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _wait_for(client: subprocess.Popen, nodes: list[subprocess.Popen], timeout: float) -> None:
    """Until ``client`` is done; stop early when one of ``nodes`` exits first (no server to answer)."""
    deadline = time.monotonic() + timeout
    while client.poll() is None and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)


def _metric(metrics: list[str], prefix: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics if ln.startswith(prefix))


@needs_stories
def test_a_decode_worker_on_another_host_gives_the_single_engines_text(tmp_path):
    llm = LLM(str(STORIES), **ENGINE, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [r.outputs[0].text for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    arch = llm.engine.arch
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # float32 K and V
    with two_hosts() as (first, second):
        received_before = second.link_bytes()[0]
        logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
        nodes = [_start(_node(h, first, rank), log) for rank, (h, log) in enumerate(zip((first, second), logs))]
        client = subprocess.Popen(first.command([sys.executable, "-c", CLIENT, f"http://{first.address}:{PORT}",
                                                 json.dumps(PROMPTS), str(MAX_TOKENS)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(client, nodes, timeout=420)
            nodes[0].send_signal(signal.SIGTERM)  # the front end stops its workers, the remote one too
            _wait_for(nodes[1], [], timeout=60)
        finally:
            for proc in (client, *nodes):
                proc.kill()
        client_out, client_err = client.communicate()
        front_err, remote_err = (log.read_text()[-3000:] for log in logs)
        assert client.returncode == 0, client_err[-2000:] + front_err + remote_err
        got = json.loads(client_out)
        texts = [a["choices"][0]["text"] for a in got["answers"]]
        assert texts == expected, front_err
        assert nodes[1].returncode == 0, remote_err
        # Every prompt's KV went to the decode worker on the second host, over the link.
        moved = _metric(got["metrics"], 'travelator_disagg_kv_transfer_bytes_total{index="0",role="decode"}')
        prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in got["answers"])
        assert moved >= prompt_tokens * kv_bytes_per_token
        assert second.link_bytes()[0] - received_before > moved
