"""Start-up memory profile of a CUDA device, for sizing the KV pool (engine/kv_sizing.py): what
is in use once the weights are loaded, and the activation peak of one dummy step of the largest
batch the scheduler may form (``max_num_batched_tokens`` prompt tokens spread over
``max_num_seqs`` requests, each sampled, as vLLM's profile run does), run before the pool
exists.

The device's numbers come through ``MemoryStats``, so that the control flow runs on the CPU
with fake numbers in tests; ``CudaMemoryStats`` reads torch.cuda's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from travelator.engine.block_manager import blocks_for
from travelator.engine.executor import Executor
from travelator.engine.kv_sizing import MemoryProfile
from travelator.engine.scheduler_output import NewRequestData, SchedulerOutput
from travelator.sampling_params import SamplingParams


class MemoryStats(Protocol):
    def total(self) -> int:
        """The device's memory, in bytes."""
        ...

    def in_use(self) -> int:
        """Bytes in use on the device, by anyone (total less free)."""
        ...

    def release_cached(self) -> None:
        """Give memory the allocator caches but holds nothing in back to the device."""
        ...

    def reset_peak(self) -> None:
        ...

    def allocated(self) -> int:
        """Bytes this process's tensors hold now."""
        ...

    def peak_allocated(self) -> int:
        """The most bytes this process's tensors held since ``reset_peak``."""
        ...


class CudaMemoryStats:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)  # the step's kernels have run
        return torch.cuda.max_memory_allocated(self.device)


def device_memory_stats(device: torch.device) -> MemoryStats | None:
    """The memory numbers of a device whose KV pool is sized by profiling; None: the CPU's
    sizing (a share of free host memory)."""
    return CudaMemoryStats(device) if device.type == "cuda" else None


@dataclass(frozen=True, slots=True)
class LargestStep:
    num_tokens: int  # max_num_batched_tokens
    num_seqs: int  # max_num_seqs
    max_model_len: int
    block_size: int


def profile_memory(runner: Executor, stats: MemoryStats, step: LargestStep) -> MemoryProfile:
    """Measure, after the weights are loaded and before the KV pool is allocated: memory in
    use, then the peak of one dummy step of ``step`` over what was allocated before it. The
    step writes its KV to a scratch pool just big enough for it, dropped afterwards."""
    stats.release_cached()  # the loader's freed buffers are not in use
    in_use = stats.in_use()
    out, num_blocks = dummy_step(step)
    runner.allocate_kv_cache(num_blocks, step.block_size)
    before = stats.allocated()
    stats.reset_peak()
    try:
        runner.execute(out)
    finally:  # the runner forgets the dummy requests whatever happened
        runner.execute(SchedulerOutput(freed_request_ids=list(out.num_scheduled_tokens)))
    peak = stats.peak_allocated() - before
    runner.allocate_kv_cache(0, step.block_size)  # drop the scratch pool
    stats.release_cached()
    # What the first step left in use outside torch's tensors (library workspaces, compiled
    # kernels) stays for good: count it too.
    in_use = max(in_use, stats.in_use())
    return MemoryProfile(stats.total(), in_use, max(peak, 0))


def dummy_step(step: LargestStep) -> tuple[SchedulerOutput, int]:
    """``num_tokens`` prompt tokens spread over up to ``num_seqs`` new requests (none longer
    than a context leaves for its first token), each on blocks of its own; and how many blocks
    they take."""
    n = min(step.num_seqs, step.num_tokens)
    lengths = [min(step.num_tokens // n + (i < step.num_tokens % n), step.max_model_len - 1)
               for i in range(n)]
    new, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = blocks_for(length, step.block_size)
        # Random sampling with top-p: the sampler's costliest path (a sort over the vocabulary).
        params = SamplingParams(top_p=0.9, seed=i, max_tokens=1)
        new.append(NewRequestData(f"memory-profile-{i}", [0] * length, [], params,
                                  list(range(next_block, next_block + num_blocks)), 0))
        next_block += num_blocks
    ids = [r.request_id for r in new]
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens=dict(zip(ids, lengths)),
                          num_prefill_tokens=sum(lengths), prefill_request_ids=ids)
    return out, next_block
