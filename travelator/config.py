"""Engine configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SchedulerPolicy = Literal["iteration", "static"]
SchedulingOrder = Literal["fcfs", "priority"]


@dataclass(slots=True)
class ModelConfig:
    model: str  # a HF-layout directory, a .gguf file, or "dummy:<preset>"
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    load_format: str = "auto"  # "auto" or "dummy" (random weights from the config)
    max_model_len: int | None = None
    seed: int = 0


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact pool size; wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: a share of free memory, see engine
    kv_cache_dtype: str = "auto"  # "auto" follows the model dtype
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")


@dataclass(slots=True)
class SchedulerConfig:
    policy: SchedulerPolicy = "iteration"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    order: SchedulingOrder = "fcfs"  # "priority": lower Request.priority first
    max_overtakes: int = 16  # times a waiting request that does not fit may be passed

    def validate(self) -> None:
        if self.policy not in ("iteration", "static"):
            raise ValueError(f"unknown scheduler policy {self.policy!r}")
        if self.order not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling order {self.order!r}; use fcfs or priority")
        if self.order == "priority" and self.policy == "static":
            raise ValueError("priority scheduling needs the iteration-level scheduler")
        if self.max_overtakes < 0:
            raise ValueError("max_overtakes must be non-negative")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")


@dataclass(slots=True)
class ParallelConfig:
    # Ranks one model is split over (Megatron-style tensor parallelism). Above 1 the engine
    # launches size - 1 worker processes on this machine, unless torchrun launched it.
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be positive")


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> None:
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
