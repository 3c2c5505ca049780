"""travelator: an LLM inference server built on iteration-level scheduling.

The exports load on first use, so that importing a torch-free part (the scheduler, the
block manager, the configuration) does not pull in torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from travelator.llm import LLM, GenerationResult
    from travelator.sampling_params import SamplingParams, StopLimits

_EXPORTS = {
    "LLM": "travelator.llm",
    "GenerationResult": "travelator.llm",
    "SamplingParams": "travelator.sampling_params",
    "StopLimits": "travelator.sampling_params",
}

__all__ = ["LLM", "GenerationResult", "SamplingParams", "StopLimits"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'travelator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
