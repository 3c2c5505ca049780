"""Tensor and pipeline parallelism across two hosts, launched by torchrun as on two machines:
two network namespaces joined by a veth pair, rank 0 (the driver) on one, rank 1 on the other,
the rendezvous, the step messages and the tensors (collectives, or hidden states and logits
between stages) over that link only. The text equals one process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paths import STORIES, needs_stories
from two_hosts import Host, two_hosts

PROMPTS = ["Once upon a time", "The little dog"]
GENERATE = ["-m", "travelator.cli", "generate", "--model", str(STORIES), "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "24", "--ignore-eos", *PROMPTS]
SECRET = "0123456789abcdef-across-hosts"
PARALLEL = {"tensor": ["--device", "cpu", "--tensor-parallel-size", "2"],
            "pipeline": ["--device", "cpu", "--pipeline-parallel-size", "2"]}


def _rank(host: Host, master: Host, node_rank: int, parallel: str) -> list[str]:
    return host.command([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                         "--node-rank", str(node_rank), "--nproc-per-node", "1",
                         "--master-addr", master.address, "--master-port", "29500",
                         *GENERATE, *PARALLEL[parallel]],
                        # gloo binds the interface named here, not whatever the hostname resolves to.
                        env={"GLOO_SOCKET_IFNAME": host.interface, "TRAVELATOR_TP_SECRET": SECRET})


@pytest.fixture(scope="module")
def one_process() -> str:
    return subprocess.run([sys.executable, *GENERATE, "--device", "cpu"], capture_output=True, text=True,
                          timeout=300, check=True).stdout


@needs_stories
@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_two_ranks_over_torchrun_across_two_hosts_give_one_process_text(one_process, parallel):
    with two_hosts() as (first, second):
        sent_before = first.link_bytes()[1]
        worker = subprocess.Popen(_rank(second, first, 1, parallel), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=os.environ)
        try:
            driver = subprocess.run(_rank(first, first, 0, parallel), capture_output=True, text=True,
                                    timeout=300, env=os.environ)
            worker_out, worker_err = worker.communicate(timeout=60)
        finally:
            worker.kill()
        assert driver.returncode == 0, driver.stderr[-3000:]
        assert worker.returncode == 0, worker_err[-3000:]
        assert driver.stdout == one_process
        assert one_process.startswith(PROMPTS[0]) and worker_out == ""  # rank 1 served, printed nothing
        # The step messages and the tensors went over the link.
        assert first.link_bytes()[1] - sent_before > 20_000
