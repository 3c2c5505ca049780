"""Host memory that stays with the process from one step to the next.

glibc's malloc gives large blocks back to the kernel as soon as they are freed: a block over
its mmap threshold (128 KiB at first, raised up to 32 MiB as such blocks are freed) is
unmapped, the main heap's free top is trimmed once it passes the trim threshold, and a
thread's own arena unmaps its sub-heaps when they empty. A step allocates and frees its
activations anew each time (a long prefill's gate/up output alone is tens of megabytes), so
the next step would touch fresh pages again, and the page faults take a noticeable share of a
run's time (docs/benchmarks.md). With
blocks of up to 1 GiB taken from the heap, the heap trimmed only past 2 GiB of free top, and
every thread on the main heap (the server steps on its own thread), the pages of one step are
there for the next.

The cost is that the process keeps the largest heap it has had since the call: the runner
makes it once its weights are loaded, so that is a step's activations and the KV cache.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
from pathlib import Path

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Blocks up to this size come from the heap: any step's activations on this engine's models.
HEAP_BLOCKS_UP_TO = 1 << 30
# glibc's ceiling for its own dynamic threshold on 64-bit machines: for a glibc that refuses more.
DYNAMIC_THRESHOLD_CEILING = 32 << 20
# The largest trim threshold mallopt's int takes: the heap's top is trimmed past 2 GiB free only.
TRIM_PAST = (1 << 31) - 1


@functools.cache
def retain_freed_memory() -> bool:
    """Keep freed host memory in the process (once per process). Returns whether the C
    library took every setting: glibc only; elsewhere the allocator is left as it is."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Threads started from now on share the main heap, where the trim threshold holds (a
    # thread's own arena gives back its sub-heaps whatever the threshold).
    one_heap = mallopt(M_ARENA_MAX, 1) == 1
    from_heap = (mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO) == 1
                 or mallopt(M_MMAP_THRESHOLD, DYNAMIC_THRESHOLD_CEILING) == 1)
    kept = mallopt(M_TRIM_THRESHOLD, TRIM_PAST) == 1
    taken = one_heap and from_heap and kept
    if not taken:
        log.warning("glibc refused some of the malloc settings that keep freed memory (one heap %s, "
                    "blocks from the heap %s, no trimming %s); steps may page-fault", one_heap, from_heap, kept)
    return taken


def available_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory new allocations can take: the kernel's MemAvailable, or less where the
    process's memory cgroup (a container's limit) leaves less room; None where neither says."""
    room = [r for r in (_mem_available(proc), _cgroup_room(proc, cgroups)) if r is not None]
    return min(room) if room else None


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(proc: Path, cgroups: Path) -> int | None:
    """Limit less usage of the process's memory cgroup (v2: ``0::path``; v1: ``N:memory:path``),
    looked up at its path and, where a container shows only its own, at the mount's root."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            places, files = [cgroups / path.lstrip("/"), cgroups], ("memory.max", "memory.current")
            cache_key = "inactive_file"
        elif "memory" in controllers.split(","):
            places, files = [cgroups / "memory" / path.lstrip("/"), cgroups / "memory"], (
                "memory.limit_in_bytes", "memory.usage_in_bytes")
            cache_key = "total_inactive_file"
        else:
            continue
        for place in places:
            try:
                limit, usage = ((place / f).read_text().strip() for f in files)
                # v2 says "max" for no limit; v1 a number near 2^63.
                if limit == "max" or int(limit) >= 1 << 60:
                    break
                return max(int(limit) - int(usage) + _inactive_file(place, cache_key), 0)
            except (OSError, ValueError):
                continue
    return None


def _inactive_file(place: Path, key: str) -> int:
    """The cgroup's inactive file pages (``key`` of its memory.stat; 0 where unreadable): page
    cache (a model file just read) counted in its usage that the kernel reclaims before it
    fails an allocation, so room all the same, as a container's working set leaves it out."""
    try:
        for line in (place / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0
