"""Disjoint shares of this process's cores, one per replica.

Where the cores fall into cache domains (L3 slices, which on the machines this runs on also
bound NUMA nodes) and their count is a multiple of the replicas', each replica takes whole
domains: a replica's threads then share one cache and one memory controller. Otherwise the
cores, in order, are cut into near-equal contiguous runs.
"""

from __future__ import annotations

import os
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's list format: ``0-3,8,10-11``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def cache_domains(cpus: list[int], sys_cpu: Path = _SYS_CPU) -> list[list[int]]:
    """``cpus`` grouped by the last-level cache they share (one group when it is unknown)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in cpus:
        shared = sys_cpu / f"cpu{cpu}" / "cache" / "index3" / "shared_cpu_list"
        try:
            key = tuple(parse_cpu_list(shared.read_text()))
        except (OSError, ValueError):
            key = ()
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def core_shares(replicas: int, cpus: list[int] | None = None,
                domains: list[list[int]] | None = None) -> list[frozenset[int]]:
    """``replicas`` disjoint, non-empty sets of cores out of ``cpus`` (default: the cores this
    process may run on), whole ``domains`` each where that divides evenly."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if replicas < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {replicas}")
    if replicas > len(cpus):
        raise ValueError(f"--data-parallel-size {replicas} needs a core per replica; "
                         f"this process may use {len(cpus)}")
    domains = cache_domains(cpus) if domains is None else domains
    if len(domains) > 1 and len(domains) % replicas == 0:
        per = len(domains) // replicas
        return [frozenset(c for d in domains[i * per:(i + 1) * per] for c in d)
                for i in range(replicas)]
    base, extra = divmod(len(cpus), replicas)
    shares, start = [], 0
    for i in range(replicas):
        size = base + (1 if i < extra else 0)
        shares.append(frozenset(cpus[start:start + size]))
        start += size
    return shares
