"""Host memory that stays with the process from one step to the next.

glibc's malloc gives large blocks back to the kernel as soon as they are freed: a block over
its mmap threshold (128 KiB at first, raised as such blocks are freed) is unmapped, and the
heap's free top is trimmed once it passes the trim threshold (twice the mmap threshold). A
step allocates and frees its activations anew each time (a 2,048-token prefill of the 250M
model makes a 23 MB gate/up output), so the next step touched fresh pages again: 400,000 to
630,000 page faults in one run of workload W at 250M, a tenth of its time on a 2-core VM
(docs/benchmarks.md). With blocks of up to 32 MiB taken from the heap and the heap never
trimmed, the pages of one step are there for the next.

The cost is that the process keeps the largest heap it ever had; a step's activations are
bounded by the token budget, so that is bounded too. Blocks over 32 MiB (glibc's limit for
the threshold on 64-bit machines) are still mapped and unmapped each time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit machines (HEAP_MAX_SIZE / 2).
LARGEST_MMAP_THRESHOLD = 32 << 20
# mallopt takes an int: the largest trim threshold it can be given, which never trims here.
NEVER_TRIM = (1 << 31) - 1


@functools.lru_cache(maxsize=None)
def retain_freed_memory() -> bool:
    """Keep freed host memory in the process (once per process). Returns whether the C
    library took it: glibc only; elsewhere the allocator is left as it is."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    taken = (mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD) == 1
             and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1)
    if not taken:
        log.warning("glibc refused the malloc settings that keep freed memory; steps may page-fault")
    return taken
