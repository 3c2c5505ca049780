"""Freed host memory stays with the process, so a step's activations do not page-fault anew.

Each case runs in its own interpreter (malloc's settings are per process), with no malloc
settings from the environment. Three 24 MiB blocks are allocated as torch's CPU allocator
does (posix_memalign, 64-byte aligned), touched and freed, sixteen rounds over, as a step's
activations are, on the main thread or on a thread of their own (the server steps on one);
the page faults of the last four rounds are counted. With glibc's defaults the heap gives the
blocks back to the kernel after each round (its trim threshold is twice the largest mmapped
block freed so far; a thread's arena unmaps its emptied sub-heaps), so every round faults on
one to all three blocks again. With the engine's settings the heap settles after a few rounds
(the aligned blocks leave small pieces behind that shift the next round) and then faults on
almost none.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = [
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"),
    pytest.mark.skipif(THP.exists() and "[always]" in THP.read_text(),
                       reason="huge pages for every heap would hide the faults"),
]

ROUNDS = """
import ctypes, resource, threading
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [ctypes.c_void_p() for _ in range(3)]
def one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for b in blocks:
        assert libc.posix_memalign(ctypes.byref(b), 64, 24 << 20) == 0
        ctypes.memset(b, 1, 24 << 20)
    for b in blocks:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = []
def rounds():
    faults.extend(one_round() for _ in range(16))
if ON_A_THREAD:
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
else:
    rounds()
print(*faults[-4:])
"""
BLOCK_PAGES = (24 << 20) // resource.getpagesize()


def last_rounds_faults(setup: str, on_a_thread: bool = False) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    code = f"ON_A_THREAD = {on_a_thread}\n{setup}{ROUNDS}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()[-4:]]


RETAIN = "from travelator.model.host_memory import retain_freed_memory\nassert retain_freed_memory()\n"
RUNNER = ("import torch\nfrom travelator.config import ModelConfig\n"
          "from travelator.engine.model_runner import ModelRunner, RunnerSettings\n"
          "from travelator.model.arch import preset\n"
          "ModelRunner(ModelConfig('dummy:tiny', kernels='torch'), preset('tiny'), None, "
          "RunnerSettings(torch.float32, torch.float32, torch.device('cpu'), max_model_len=64))\n")


@pytest.mark.parametrize("on_a_thread", [False, True], ids=["main thread", "own thread"])
def test_glibc_defaults_fault_again_so_the_check_can_fail(on_a_thread):
    assert min(last_rounds_faults("", on_a_thread)) > BLOCK_PAGES // 2


@pytest.mark.parametrize("on_a_thread", [False, True], ids=["main thread", "own thread"])
def test_retained_memory_does_not_fault_again(on_a_thread):
    assert max(last_rounds_faults(RETAIN, on_a_thread)) < BLOCK_PAGES // 20


def test_a_cpu_model_runner_retains_freed_memory():
    assert max(last_rounds_faults(RUNNER)) < BLOCK_PAGES // 20


def _proc(tmp_path, cgroup: str, available_kib: int = 8 * 1024 * 1024):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _files(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_available_bytes_is_the_least_of_the_kernel_and_the_memory_cgroup(tmp_path):
    """MemAvailable (8 GiB here) unless the process's memory cgroup, as a container's limit,
    leaves less (its inactive page cache counted as room); v2 and v1, at the process's path or
    the mount's root; no limit, no cgroup files and garbled files leave MemAvailable."""
    from travelator.model.host_memory import available_bytes

    gib = 1 << 30
    cgroups = tmp_path / "cgroup"
    # v2 at the process's path: 2 GiB limit, 0.5 GiB used.
    proc = _proc(tmp_path / "a", "0::/box/one\n")
    _files(cgroups / "box" / "one", memory_max=str(2 * gib), memory_current=str(gib // 2))
    assert available_bytes(proc, cgroups) == 3 * gib // 2
    # Of the usage, 0.25 GiB is inactive page cache: reclaimable, so room.
    _files(cgroups / "box" / "one", memory_stat=f"anon 1000\ninactive_file {gib // 4}\nactive_file 5\n")
    assert available_bytes(proc, cgroups) == 7 * gib // 4
    # v2, no limit.
    _files(cgroups / "box" / "one", memory_max="max")
    assert available_bytes(proc, cgroups) == 8 * gib
    # v1, a container that shows only its own cgroup at the mount's root: 1 GiB of room.
    proc = _proc(tmp_path / "b", "4:memory:/docker/abc\n0::/\n")
    _files(cgroups / "memory", memory_limit_in_bytes=str(4 * gib), memory_usage_in_bytes=str(3 * gib))
    assert available_bytes(proc, cgroups) == gib
    _files(cgroups / "memory", memory_stat=f"cache 9\ntotal_inactive_file {gib // 2}\n")
    assert available_bytes(proc, cgroups) == 3 * gib // 2
    # v1 without a limit (a number near 2^63), and garbage: MemAvailable.
    _files(cgroups / "memory", memory_limit_in_bytes="9223372036854771712")
    assert available_bytes(proc, cgroups) == 8 * gib
    _files(cgroups / "memory", memory_limit_in_bytes="lots")
    assert available_bytes(proc, cgroups) == 8 * gib
    # Nothing readable at all.
    assert available_bytes(tmp_path / "nowhere", cgroups) is None
