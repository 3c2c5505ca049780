"""The one place a scheduler is chosen from its configuration (the engine and the tests)."""

from __future__ import annotations

import time
from collections.abc import Callable

from travelator.config import SchedulerConfig
from travelator.engine.block_manager import KVCacheManager
from travelator.engine.iteration_scheduler import (
    IterationScheduler,
    PriorityScheduler,
    WholePromptScheduler,
)
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.static_scheduler import DynamicScheduler, StaticScheduler


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager,
                   clock: Callable[[], float] = time.monotonic) -> SchedulerBase:
    if config.batching == "static":
        return StaticScheduler(config, kv, clock)
    if config.batching == "dynamic":
        return DynamicScheduler(config, kv, clock)
    if config.batching == "orca":
        return WholePromptScheduler(config, kv, clock)
    if config.scheduling_policy == "priority":
        return PriorityScheduler(config, kv, clock)
    return IterationScheduler(config, kv, clock)
