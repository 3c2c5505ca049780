"""Bodies of the endpoints routers poll (``router_probes.py``), in SGLang's field names."""

from __future__ import annotations

from pydantic import BaseModel


class LoadReport(BaseModel):
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int  # preempted requests and those held back included
    num_used_tokens: int  # in whole KV blocks
    max_total_num_tokens: int  # the KV pool
    max_running_requests: int
    token_usage: float  # num_used_tokens / max_total_num_tokens


class Loads(BaseModel):
    loads: list[LoadReport]


class GetLoad(BaseModel):
    load: int


class ServerInfo(BaseModel):
    model_path: str
    served_model_name: str
    max_total_num_tokens: int
    max_running_requests: int
    context_length: int
    version: str
    dp_size: int = 1


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True
