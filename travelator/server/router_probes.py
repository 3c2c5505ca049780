"""What the routers that front vLLM and SGLang fleets poll on a worker, with the meaning they
expect, so that ``vllm-router`` and ``smg`` (the SGLang model gateway) can route to travelator
servers with their load- and cache-aware policies:

- ``GET /v1/loads`` (SGLang's load snapshot, ``smg``'s load monitor): one entry, ``dp_rank``
  0, with the requests running and waiting, the KV tokens in use and in the pool (whole
  blocks: ``num_used_tokens`` counts the tokens of used blocks), the most requests a step
  runs, and ``token_usage``, the fraction of the pool in use;
- ``GET /get_load`` (SGLang router's power-of-two policy): ``{"load": running + waiting}``;
- ``GET /server_info`` and ``/get_server_info``: the served model and those capacities;
- ``GET /get_model_info`` (SGLang): the model and that it generates.

``/health``, ``/v1/models`` and ``/metrics`` are the server's own and already answer as they
expect (200 while serving, the served names, Prometheus text).
"""

from __future__ import annotations

from fastapi import APIRouter

from travelator.engine.client import EngineSnapshot
from travelator.server.protocol_router import GetLoad, LoadReport, Loads, ModelInfo, ServerInfo
from travelator.server.serving import OpenAIServing
from travelator.server.tokenize import server_version


def load_report(snap: EngineSnapshot, block_size: int, max_num_seqs: int) -> LoadReport:
    return LoadReport(dp_rank=0, num_running_reqs=snap.num_running, num_waiting_reqs=snap.num_waiting,
                      num_used_tokens=snap.kv_used_blocks * block_size,
                      max_total_num_tokens=snap.kv_total_blocks * block_size,
                      max_running_requests=max_num_seqs, token_usage=snap.kv_usage)


def router_probe_routes(serving: OpenAIServing) -> APIRouter:
    client, model = serving.client, serving.model
    router = APIRouter()

    def report() -> LoadReport:
        return load_report(client.snapshot(), model.kv_block_size, model.max_num_seqs)

    @router.get("/v1/loads")
    async def loads() -> Loads:
        return Loads(loads=[report()])

    @router.get("/get_load")
    async def get_load() -> GetLoad:
        load = report()
        return GetLoad(load=load.num_running_reqs + load.num_waiting_reqs)

    async def server_info() -> ServerInfo:
        load = report()
        return ServerInfo(model_path=model.name, served_model_name=serving.served_model_names[0],
                          max_total_num_tokens=load.max_total_num_tokens,
                          max_running_requests=load.max_running_requests,
                          context_length=model.max_model_len, version=server_version())

    router.add_api_route("/server_info", server_info, methods=["GET"])
    router.add_api_route("/get_server_info", server_info, methods=["GET"])

    @router.get("/get_model_info")
    async def model_info() -> ModelInfo:
        return ModelInfo(model_path=model.name, tokenizer_path=model.name)

    return router
