"""The KV pool's size on a CUDA device, as GPU servers size it (vLLM's
``gpu_memory_utilization``): the engine may use that share of the device's total memory; the
pool gets what is left of it once the weights are loaded and room is kept for the largest
step's activations, measured by running that step once (engine/kv_profile.py).

Pure arithmetic over given numbers, so that it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from travelator.engine.block_manager import blocks_for

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What start-up measured on the device, in bytes."""

    total: int  # the device's memory
    in_use: int  # in use once the weights are loaded (the CUDA context and other processes too)
    activation_peak: int  # the most one step of the largest batch allocates on top of that


def kv_pool_bytes(utilization: float, profile: MemoryProfile) -> int:
    """Bytes the KV pool may take: utilization x total, less what is in use and the peak."""
    return int(utilization * profile.total) - profile.in_use - profile.activation_peak


def kv_pool_blocks(utilization: float, profile: MemoryProfile, bytes_per_block: int, block_size: int,
                   max_model_len: int) -> int:
    """Blocks of ``bytes_per_block`` that fit the pool's share; ValueError when they do not hold
    one full context of ``max_model_len`` tokens (a request that long could never finish)."""
    budget = kv_pool_bytes(utilization, profile)
    num_blocks = max(budget, 0) // bytes_per_block
    needed = blocks_for(max_model_len, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV pool does not hold one full context: gpu_memory_utilization {utilization} of "
            f"{_gib(profile.total)} GiB, less {_gib(profile.in_use)} GiB in use after loading the "
            f"weights and an activation peak of {_gib(profile.activation_peak)} GiB, leaves "
            f"{_gib(budget)} GiB, and max_model_len {max_model_len} needs "
            f"{_gib(needed * bytes_per_block)} GiB; raise gpu_memory_utilization, lower "
            f"max_model_len, or lower max_num_batched_tokens or max_num_seqs (the activation peak)")
    return num_blocks


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f}"
