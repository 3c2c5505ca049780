"""travelator: an LLM inference server built on iteration-level scheduling."""

from travelator.llm import LLM, GenerationResult
from travelator.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationResult", "SamplingParams"]
