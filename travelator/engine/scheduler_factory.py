"""The one place a scheduler is chosen from its configuration (the engine and the tests)."""

from __future__ import annotations

from travelator.config import SchedulerConfig
from travelator.engine.kv_cache import KVCacheManager
from travelator.engine.scheduler import IterationScheduler, PriorityScheduler, SchedulerBase
from travelator.engine.static_scheduler import StaticScheduler


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager) -> SchedulerBase:
    if config.batching == "static":
        return StaticScheduler(config, kv)
    if config.scheduling_policy == "priority":
        return PriorityScheduler(config, kv)
    return IterationScheduler(config, kv)
