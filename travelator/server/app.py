"""The FastAPI app: OpenAI-compatible endpoints over an ``EngineClient`` (``engine/client.py``).

``build_app(client, settings)`` returns an ASGI app whose lifespan starts the engine on the
serving event loop and stops it at shutdown. It knows no concrete engine: whoever builds the
app (``travelator serve``, in ``cli.py``; the tests) chooses one. Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not)
- ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` (responses.py)
- ``GET /v1/models``, ``GET /v1/models/{model}``
- ``GET /health`` (200 while the step loop runs, 503 when it died, when a step has run past
  ``settings.step_timeout_s``, or when the server is draining)
- ``GET /metrics`` (Prometheus text, this app's own registry)
- ``GET /dashboard`` (the live view of the batch, step by step) and ``GET /dashboard/stream``
  (its records, server-sent events): see ``travelator/dashboard/``
- ``GET /debug/engine`` only with ``settings.enable_debug_endpoints``: the engine's self-check
  (KV blocks free, used and per owner, queues, the pool's consistency check, leaks), read on the
  step thread between two steps

With ``settings.api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise);
``/health`` and ``/metrics`` stay open for probes and scrapers. Every error is an OpenAI-style
JSON body (see ``errors.py``).

The completion endpoints read and validate their bodies themselves (``body.py``), so the
OpenAPI schema is told about the bodies explicitly (``_body_schema``): clients and fuzzers
(tests/server/test_fuzz_api.py) generate requests from ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from travelator.dashboard.feed import StepFeed
from travelator.dashboard.routes import dashboard_routes
from travelator.dashboard.walkway import WalkwayRecorder
from travelator.engine.client import EngineClient
from travelator.server.auth import bearer_matches
from travelator.server.body import read_body
from travelator.server.chat import create_chat_completion
from travelator.server.completions import create_completion
from travelator.server.errors import APIError, install_error_handlers
from travelator.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from travelator.server.pooling import pooling_routes
from travelator.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from travelator.server.response_store import ResponseStore
from travelator.server.responses import create_response, delete_response, get_response
from travelator.server.responses_protocol import ResponseObject, ResponsesRequest
from travelator.server.router_probes import router_probe_routes
from travelator.server.serving import OpenAIServing
from travelator.server.settings import ServerSettings
from travelator.server.streaming import json_response
from travelator.server.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    server_version,
    tokenize,
)

logger = logging.getLogger(__name__)

__all__ = ["build_app", "ServerSettings"]


_REF = "#/components/schemas/{model}"


def _body_schema(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict:
    """OpenAPI for a route that reads its own body: the JSON request body, the JSON or
    server-sent-event answer, and the error bodies."""
    def ref(model: type[BaseModel]) -> dict:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request_model)}}},
        "responses": {
            "200": {"description": "the completion, or with stream=true server-sent events of chunks",
                    "content": {"application/json": {"schema": ref(response_model)},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request", **error},
            "401": {"description": "missing or wrong API key", **error},
            "404": {"description": "unknown model", **error},
            "413": {"description": "request body too large", **error},
            "503": {"description": "overloaded, shutting down or engine stopped", **error},
        },
    }


def _install_openapi(app: FastAPI) -> None:
    models = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
    outputs = [CompletionResponse, ChatCompletionResponse, ResponseObject, TokenizeResponse,
               DetokenizeResponse, ErrorResponse]

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models]
                                         + [(m, "serialization") for m in outputs], ref_template=_REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model_schema in defs.get("$defs", {}).items():
                components.setdefault(name, model_schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(client: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    settings.validate()
    names = list(settings.served_model_names) or [client.served_model.name]
    metrics = ServerMetrics(client, names[0])
    client.step_listeners.append(metrics.on_step)
    serving = OpenAIServing(client, settings, metrics, names)
    feed = StepFeed()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.loop = asyncio.get_running_loop()
        feed.bind(serving.loop)
        if not client.healthy and client.error is None:
            client.start()
        logger.info("serving %s (context %d tokens)", ", ".join(names), client.served_model.max_model_len)
        try:
            yield
        finally:
            feed.close()
            serving.preprocessor.close()
            serving.draining = True
            client.stop_accepting()
            client.abort_all()
            # A loop declared dead may still be stuck in its step: do not wait long for it.
            await asyncio.to_thread(client.stop, 10.0 if client.error is None else 1.0)

    app = FastAPI(title="travelator", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.settings = settings
    install_error_handlers(app)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods,
                           allow_headers=settings.allowed_headers)
    _install_openapi(app)
    require_api_key = _api_key_check(settings)
    store = ResponseStore(settings.response_store_max_count, settings.response_store_max_bytes,
                          settings.response_store_ttl_s)
    app.include_router(_v1_routes(serving, store, require_api_key))
    app.include_router(pooling_routes(serving, require_api_key))
    app.include_router(_tokenizer_routes(serving, require_api_key))
    app.include_router(router_probe_routes(serving))  # open, as /health is: routers poll them
    _add_operator_routes(app, serving, require_api_key)
    if settings.dashboard:
        app.include_router(_dashboard(client, settings, metrics, feed))
        serving.on_shutdown.append(feed.close)  # its streams never end by themselves
        client.death_listeners.append(lambda exc: feed.close_soon())  # nor when the engine dies
    return app


def _dashboard(client: EngineClient, settings: ServerSettings, metrics: ServerMetrics,
               feed: StepFeed) -> APIRouter:
    """The live view: a recorder on the step thread publishes each step to ``feed``."""
    batch = client.live_batch()
    if batch is None:  # a disaggregated front end: no batch of its own
        return dashboard_routes(feed, {}, settings.api_key, unavailable=(
            "the live view shows one engine's batch; with --disaggregate each worker has its own "
            "(see /metrics for per-worker figures)"))
    recorder = WalkwayRecorder(batch.engine, show_prompts=settings.dashboard_show_prompts,
                               rejected=lambda: metrics.num_rejected)

    def publish(stats, outputs) -> None:
        feed.publish(recorder.record(outputs))

    batch.step_listeners.append(publish)
    batch.idle_listeners.append(lambda: feed.publish(recorder.record([], idle=True)))
    return dashboard_routes(feed, recorder.info(), settings.api_key)


def _tokenizer_routes(serving: OpenAIServing, require_api_key) -> APIRouter:
    """vLLM's /tokenize, /detokenize, /tokenizer_info and /version (outside /v1, as vLLM
    serves them)."""
    limit, preprocessor = serving.settings.max_body_bytes, serving.preprocessor
    router = APIRouter(dependencies=[Depends(require_api_key)])

    # The answer is written on the worker too: a megabyte prompt's ids are a long JSON array.
    @router.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest, TokenizeResponse))
    async def tokenize_route(request: Request) -> Response:
        req = await read_body(request, TokenizeRequest, limit, preprocessor)
        return await preprocessor.run(lambda: json_response(tokenize(serving, req.root)))

    @router.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest, DetokenizeResponse))
    async def detokenize_route(request: Request) -> Response:
        req = await read_body(request, DetokenizeRequest, limit, preprocessor)
        return await preprocessor.run(lambda: json_response(detokenize(serving, req)))

    @router.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        """The tokenizer's configuration (special tokens, chat template): what a client needs
        to use /tokenize and /detokenize as its tokenizer (lm-evaluation-harness does)."""
        return JSONResponse(serving.tokenizer.hf_config(serving.model.max_model_len))

    @router.get("/version")
    async def version_route() -> Response:
        return JSONResponse({"version": server_version()})

    return router


def _api_key_check(settings: ServerSettings):
    """A dependency that demands ``Authorization: Bearer <key>`` when the server has a key."""
    async def require_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        if not bearer_matches(request.headers.get("authorization", ""), settings.api_key):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return require_api_key


def _v1_routes(serving: OpenAIServing, store: ResponseStore, require_api_key) -> APIRouter:
    """The OpenAI API: completions, chat completions, responses (``store``: those kept), models."""
    model = serving.model
    limit, preprocessor = serving.settings.max_body_bytes, serving.preprocessor
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.post("/completions", openapi_extra=_body_schema(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        req = await read_body(request, CompletionRequest, limit, preprocessor)
        return await create_completion(serving, req, request)

    @v1.post("/responses", openapi_extra=_body_schema(ResponsesRequest, ResponseObject))
    async def responses(request: Request) -> Response:
        req = await read_body(request, ResponsesRequest, limit, preprocessor)
        return await create_response(serving, store, req, request)

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return get_response(store, response_id)

    @v1.delete("/responses/{response_id}")
    async def remove_response(response_id: str) -> Response:
        return delete_response(store, response_id)

    @v1.post("/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        req = await read_body(request, ChatCompletionRequest, limit, preprocessor)
        return await create_chat_completion(serving, req, request)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=model.name, max_model_len=model.max_model_len)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in serving.served_model_names])

    @v1.get("/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        return card(serving.resolve_model(model))

    return v1


def _add_operator_routes(app: FastAPI, serving: OpenAIServing, require_api_key) -> None:
    """/health, /metrics and, when enabled, /debug/engine."""
    client, settings = serving.client, serving.settings

    @app.get("/health")
    async def health() -> Response:
        if not client.healthy:
            return APIError(503, f"the engine loop is not running: {client.error!r}",
                            code="engine_dead").response()
        running_for = client.step_running_for()
        if settings.step_timeout_s is not None and running_for > settings.step_timeout_s:
            return APIError(503, f"the engine is stuck: one step has run {running_for:.1f} s "
                                 f"(limit {settings.step_timeout_s} s)", code="engine_stuck").response()
        if serving.draining:
            return APIError(503, "the server is shutting down", code="shutting_down").response()
        if (degraded := client.degraded) is not None:  # still serving, with less
            return JSONResponse({"status": "degraded", "detail": degraded})
        return JSONResponse({"status": "ok"})

    if settings.enable_debug_endpoints:
        @app.get("/debug/engine", dependencies=[Depends(require_api_key)])
        async def debug_engine() -> Response:
            """The engine's self-check, read between two steps (see ``engine_self_check``)."""
            try:
                report = await client.self_check(timeout=30.0)
            except TimeoutError as exc:
                raise APIError(503, str(exc), code="engine_busy") from None
            return JSONResponse(report)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
