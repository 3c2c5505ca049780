"""Tensor and pipeline parallelism with the ranks placed by Ray (``--distributed-executor-backend
ray``) across two hosts: two network namespaces joined by a veth pair, a Ray head node (1 CPU)
on the first, a Ray worker node (1 CPU) on the second, both started and stopped here. The
driver runs on the head; the placement group must put rank 1 on the other node, so the
rendezvous, the control messages and the tensors cross the link. The text equals one process's.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from paths import STORIES, needs_stories
from ray_cluster import address, ray_cluster
from travelator.engine.ray_placement import RayPlacementError, join_cluster
from two_hosts import Host

pytest.importorskip("ray", reason="Ray is not installed (the test extra has it)")

PROMPTS = ["Once upon a time", "The little dog"]
GENERATE = ["generate", "--model", str(STORIES), "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "24", "--ignore-eos", *PROMPTS]
PARALLEL = {"tensor": ["--device", "cpu", "--tensor-parallel-size", "2"],
            "pipeline": ["--device", "cpu", "--pipeline-parallel-size", "2"]}


def test_without_a_cluster_or_without_ray_the_error_says_what_to_do(monkeypatch):
    # First in the module: Ray's "auto" also finds a cluster by its processes, such as this module's.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayPlacementError, match="no Ray cluster to join at 'auto'.*ray start --head"):
        join_cluster()
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    with pytest.raises(RayPlacementError, match="needs Ray"):
        join_cluster()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Host, Host]]:
    """A Ray cluster of two 1-CPU nodes, one per host."""
    with ray_cluster(cpus=1) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def one_process() -> str:
    return subprocess.run([sys.executable, "-m", "travelator.cli", *GENERATE, "--device", "cpu"], capture_output=True, text=True,
                          timeout=300, check=True).stdout


def _driver(host: Host, *flags: str, env: dict[str, str] | None = None) -> list[str]:
    return host.command([sys.executable, "-m", "travelator.cli", "--log-level", "INFO", *GENERATE, *flags,
                         "--distributed-executor-backend", "ray"],
                        env={"RAY_ADDRESS": address(host), **(env or {})})


@needs_stories
@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_ray_places_rank_1_on_the_other_host_and_the_text_is_one_process_text(cluster, one_process, parallel):
    first, second = cluster
    sent_before = first.link_bytes()[1]
    driver = subprocess.run(_driver(first, *PARALLEL[parallel]), capture_output=True, text=True, timeout=300)
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert f"rank 1 on Ray node {second.address}" in driver.stderr
    assert driver.stdout == one_process and one_process.startswith(PROMPTS[0])
    # The step messages and the tensors went over the link.
    assert first.link_bytes()[1] - sent_before > 20_000


@needs_stories
def test_a_group_the_cluster_cannot_hold_fails_in_time_saying_what_is_missing(cluster):
    first, _ = cluster
    # Three 1-CPU ranks on two 1-CPU nodes: the group can never be granted.
    driver = subprocess.run(_driver(first, "--device", "cpu", "--pipeline-parallel-size", "3",
                                    env={"TRAVELATOR_RAY_GROUP_TIMEOUT": "3"}),
                            capture_output=True, text=True, timeout=120)
    assert driver.returncode == 2 and driver.stdout == ""  # the command line's error for a setting
    assert "error: the Ray cluster did not grant the placement group within 3 s: 3 bundles of 1 CPU(s)" \
        in driver.stderr, driver.stderr[-3000:]
    assert "3 CPUs in all; the cluster has 2 CPUs" in driver.stderr

