"""Freed host memory stays with the process, so a step's activations do not page-fault anew.

Each case runs in its own interpreter (malloc's settings are per process). Three 24 MB blocks
are allocated as torch's CPU allocator does (posix_memalign, 64-byte aligned), touched and
freed, eight rounds over, as a step's activations are; the page faults of the last three rounds
are counted. glibc's defaults trim the freed 72 MB off the heap after each round (the trim
threshold is twice the largest block freed so far), so every round faults on every page
again; with the engine's settings the heap settles within four rounds (the aligned
blocks leave small pieces behind that shift the next round) and then faults on almost none.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

ROUND = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [ctypes.c_void_p() for _ in range(3)]
    for b in blocks:
        assert libc.posix_memalign(ctypes.byref(b), 64, 24 << 20) == 0
        ctypes.memset(b, 1, 24 << 20)
    for b in blocks:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = [one_round() for _ in range(8)]
print(*faults[5:])
"""
PAGES = 3 * (24 << 20) // 4096


def later_rounds_faults(setup: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", setup + ROUND], capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()[-3:]]


def test_glibc_defaults_fault_again_so_the_check_can_fail():
    assert min(later_rounds_faults("")) > PAGES // 2


def test_retained_memory_does_not_fault_again():
    setup = "from travelator.model.host_memory import retain_freed_memory\nassert retain_freed_memory()\n"
    assert max(later_rounds_faults(setup)) < PAGES // 20


def test_a_cpu_model_runner_retains_freed_memory():
    setup = ("import torch\nfrom travelator.engine.model_runner import ModelRunner\n"
             "from travelator.model.arch import preset\n"
             "ModelRunner(preset('tiny'), None, dtype=torch.float32, kv_dtype=torch.float32, "
             "device=torch.device('cpu'), max_model_len=64, kernels='torch')\n")
    assert max(later_rounds_faults(setup)) < PAGES // 20

