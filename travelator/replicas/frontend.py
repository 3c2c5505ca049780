"""The replicas' front end: one FastAPI app that forwards each OpenAI request to one replica
(chosen by ``PrefixRouter``) and relays its answer, streamed or not, byte for byte.

- ``POST /v1/*``, ``/tokenize``, ``/detokenize``: routed by the prompt's leading text.
- ``GET /v1/models``, ``/v1/models/{model}``, ``/version``, ``/tokenizer_info``: any live replica
  (they all serve the same model).
- ``GET /health``: ``{"status": "ok", "replicas": [...]}`` when every replica serves; 200 with
  ``{"status": "degraded", ...}`` while some are down or restarting (the others still answer);
  503 when none is up. Each replica is listed with its URL, cores, state and restarts.
- ``GET /v1/loads``: every live replica's own report, as data-parallel rank ``index``.
- ``GET /metrics``: the front end's routing figures (``metrics.py``).

A replica that dies mid-request fails only the requests it held: a 502 (``replica_failed``)
before any of the answer came, else a last server-sent ``error`` event on a stream. Every
relayed answer names its replica in the ``x-travelator-replica`` header.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from travelator.replicas.metrics import RouteMetrics
from travelator.replicas.routing import NoReplicaAlive, PrefixRouter
from travelator.replicas.supervisor import ReplicaSet
from travelator.server.errors import APIError
from travelator.server.metrics import CONTENT_TYPE_LATEST

# Hop-by-hop and framing headers: the proxy frames its own messages.
_DROP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                           "transfer-encoding", "te", "upgrade", "proxy-connection"})


class ReplicaState(BaseModel):
    """One replica, as ``/health`` shows it."""

    index: int
    url: str
    cpus: list[int]
    up: bool
    restarts: int


def routing_text(body: bytes) -> str:
    """The text whose leading blocks key a request's prefix: a completion's prompt, a chat's
    messages, a response's instructions and input ("" when the body is not a JSON object)."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    prompt = req.get("prompt", req.get("messages", req.get("input", req.get("text", ""))))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of prompts: the first one's prefix
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    instructions = req.get("instructions")
    return (instructions + text) if isinstance(instructions, str) else text


def _forwarded(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


def build_replica_app(replicas: ReplicaSet, router: PrefixRouter) -> FastAPI:
    metrics = RouteMetrics(replicas, router)
    http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(replicas.start)
        try:
            yield
        finally:
            await http.aclose()
            await asyncio.to_thread(replicas.close)

    app = FastAPI(title="travelator replicas", lifespan=lifespan)

    async def forward(request: Request, replica: int, body: bytes, on_done) -> Response:
        url = replicas.replicas[replica].base_url + request.url.path
        upstream = http.build_request(request.method, url, content=body, params=request.query_params,
                                      headers=_forwarded(request.headers))
        try:
            answer = await http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            on_done()
            return APIError(502, f"replica {replica} failed before answering: {exc!r}",
                            code="replica_failed").response()
        event_stream = answer.headers.get("content-type", "").startswith("text/event-stream")

        async def relay():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                if event_stream:
                    error = APIError(502, f"replica {replica} failed mid-stream: {exc!r}",
                                     code="replica_failed").body().model_dump()
                    yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                await answer.aclose()
                on_done()

        headers = _forwarded(answer.headers) | {"x-travelator-replica": str(replica)}
        return StreamingResponse(relay(), status_code=answer.status_code, headers=headers)

    async def routed(request: Request) -> Response:
        body = await request.body()
        try:
            decision = router.choose(routing_text(body))
        except NoReplicaAlive as exc:
            return APIError(503, str(exc), code="no_replica").response()
        metrics.routed(decision)
        return await forward(request, decision.replica, body, lambda: router.done(decision.replica))

    async def any_replica(request: Request) -> Response:
        live = [r.index for r in replicas.replicas if r.up]
        if not live:
            return APIError(503, "no replica is running", code="no_replica").response()
        replica = min(live, key=lambda i: router.in_flight[i])
        return await forward(request, replica, b"", lambda: None)

    for path in ("/v1/{rest:path}", "/tokenize", "/detokenize"):
        app.add_api_route(path, routed, methods=["POST"])
    for path in ("/v1/models", "/v1/models/{model:path}", "/version", "/tokenizer_info"):
        app.add_api_route(path, any_replica, methods=["GET"])

    @app.get("/v1/loads")
    async def loads() -> Response:
        """Each live replica's load report as one data-parallel rank (its index), the shape
        smg reads from a server with several ranks."""
        live = [r for r in replicas.replicas if r.up]
        answers = await asyncio.gather(*(http.get(f"{r.base_url}/v1/loads", timeout=5.0) for r in live),
                                       return_exceptions=True)
        ranks = [{**answer.json()["loads"][0], "dp_rank": r.index} for r, answer in zip(live, answers)
                 if isinstance(answer, httpx.Response) and answer.status_code == 200]
        return JSONResponse({"loads": ranks})

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
