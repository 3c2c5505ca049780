"""The replicas' front end: one FastAPI app that forwards each OpenAI request to one replica
(``proxy.py``; chosen by ``PrefixRouter``).

- ``POST /v1/*``, ``/tokenize``, ``/detokenize``, ``/score``, ``/rerank``, ``/v2/rerank``:
  routed by the prompt's leading text; a response's follow-up (``previous_response_id``) to
  the replica that stored the response it follows.
- ``GET``/``DELETE /v1/responses/{id}``: to the replica that stored it.
- ``GET /v1/models``, ``/v1/models/{model}``, ``/version``, ``/tokenizer_info``: any live replica
  (they all serve the same model).
- ``GET /v1/loads``: every live replica's own report, as data-parallel rank ``index``.
- ``GET /health``: ``{"status": "ok", "replicas": [...]}`` when every replica serves; 200 with
  ``{"status": "degraded", ...}`` while some are down or restarting (the others still answer);
  503 when none is up. Each replica is listed with its URL, cores, state and restarts.
- ``GET /metrics``: the front end's routing figures (``metrics.py``).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from travelator.replicas.metrics import RouteMetrics
from travelator.replicas.proxy import ReplicaProxy
from travelator.replicas.response_homes import ResponseHomes
from travelator.replicas.routing import PrefixRouter
from travelator.replicas.supervisor import ReplicaSet
from travelator.server.errors import APIError
from travelator.server.metrics import CONTENT_TYPE_LATEST


class ReplicaState(BaseModel):
    """One replica, as ``/health`` shows it."""

    index: int
    url: str
    cpus: list[int]
    up: bool
    restarts: int


def build_replica_app(replicas: ReplicaSet, router: PrefixRouter, homes: ResponseHomes) -> FastAPI:
    metrics = RouteMetrics(replicas, router)
    proxy = ReplicaProxy(replicas, router, metrics, homes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(replicas.start)
        try:
            yield
        finally:
            await proxy.aclose()
            await asyncio.to_thread(replicas.close)

    app = FastAPI(title="travelator replicas", lifespan=lifespan)
    for path in ("/v1/{rest:path}", "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank"):
        app.add_api_route(path, proxy.routed, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", proxy.stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/loads", proxy.loads, methods=["GET"])
    for path in ("/v1/models", "/v1/models/{model:path}", "/version", "/tokenizer_info"):
        app.add_api_route(path, proxy.any_replica, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        down = [r.index for r in replicas.replicas if not r.up]
        if len(down) == len(replicas.replicas):
            return APIError(503, "no replica is running", code="no_replica").response()
        states = [ReplicaState(index=r.index, url=r.base_url, cpus=sorted(r.cpus), up=r.up,
                               restarts=r.restarts).model_dump() for r in replicas.replicas]
        if down:
            return JSONResponse({"status": "degraded", "replicas": states,
                                 "detail": f"replicas {down} of {len(states)} are restarting"})
        return JSONResponse({"status": "ok", "replicas": states})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
