"""Forwarding one request to one replica and relaying its answer, streamed or not, byte for
byte. A stored response's follow-ups, ``GET`` and ``DELETE`` go to the replica that stored it
(``response_homes.py``). A replica that dies mid-request fails only the requests it held: a 502
(``replica_failed``) before any of the answer came, else a last server-sent ``error`` event on
a stream. Every relayed answer names its replica in the ``x-travelator-replica`` header."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from travelator.replicas.metrics import RouteMetrics
from travelator.replicas.response_homes import ResponseHomes, StoredIdReader, json_body
from travelator.replicas.routing import NoReplicaAlive, PrefixRouter
from travelator.replicas.supervisor import ReplicaSet
from travelator.server.errors import APIError

# Hop-by-hop and framing headers: the proxy frames its own messages.
_DROP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                           "transfer-encoding", "te", "upgrade", "proxy-connection"})


# The fields that hold a request's prompt, by API: completions, chat, responses, tokenize,
# rerank (the query leads each document's prompt), score.
_PROMPT_FIELDS = ("prompt", "messages", "input", "text", "query", "text_1")


def routing_text(req: dict) -> str:
    """The text whose leading blocks key a request's prefix: a completion's prompt, a chat's
    messages, a response's instructions and input, a rerank's query."""
    prompt = next((req[field] for field in _PROMPT_FIELDS if field in req), "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of prompts: the first one's prefix
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    instructions = req.get("instructions")
    return (instructions + text) if isinstance(instructions, str) else text


def _forwarded(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


def _no_replica() -> Response:
    return APIError(503, "no replica is running", code="no_replica").response()


class ReplicaProxy:
    def __init__(self, replicas: ReplicaSet, router: PrefixRouter, metrics: RouteMetrics,
                 homes: ResponseHomes) -> None:
        self.replicas, self.router, self.metrics, self.homes = replicas, router, metrics, homes
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def routed(self, request: Request) -> Response:
        """A request with a prompt: to the replica ``PrefixRouter`` chooses (a response's
        follow-up: to the replica that stored the response it follows)."""
        body = await request.body()
        req = json_body(body)
        creates_response = request.url.path == "/v1/responses"
        home = self.homes.home(req.get("previous_response_id")) if creates_response else None
        try:
            decision = self.router.choose(routing_text(req), home)
        except NoReplicaAlive:
            return _no_replica()
        self.metrics.routed(decision)
        reader = StoredIdReader() if creates_response else None

        def done() -> None:
            self.router.done(decision.replica)
            if reader is not None and (stored := reader.stored_id()) is not None:
                self.homes.remember(stored, decision.replica)

        return await self.forward(request, decision.replica, body, done, reader)

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """``GET``/``DELETE /v1/responses/{id}``: to the replica that stored it; an unknown id
        to the least loaded replica, whose 404 is a single server's."""
        replica = self.homes.home(response_id)
        if replica is None or not self.replicas.replicas[replica].up:
            replica = self._least_loaded()
            if replica is None:
                return _no_replica()
        answer = await self.forward(request, replica, b"", lambda: None)
        if request.method == "DELETE" and answer.status_code == 200:
            self.homes.forget(response_id)
        return answer

    async def any_replica(self, request: Request) -> Response:
        """A request every replica answers alike (the models, the version): the least loaded."""
        replica = self._least_loaded()
        if replica is None:
            return _no_replica()
        return await self.forward(request, replica, b"", lambda: None)

    def _least_loaded(self) -> int | None:
        live = [r.index for r in self.replicas.replicas if r.up]
        return min(live, key=lambda i: self.router.in_flight[i]) if live else None

    async def loads(self) -> Response:
        """Each live replica's load report as one data-parallel rank (its index), the shape
        smg reads from a server with several ranks."""
        live = [r for r in self.replicas.replicas if r.up]
        answers = await asyncio.gather(*(self.http.get(f"{r.base_url}/v1/loads", timeout=5.0) for r in live),
                                       return_exceptions=True)
        ranks = [{**answer.json()["loads"][0], "dp_rank": r.index} for r, answer in zip(live, answers)
                 if isinstance(answer, httpx.Response) and answer.status_code == 200]
        return JSONResponse({"loads": ranks})

    async def forward(self, request: Request, replica: int, body: bytes, on_done: Callable[[], None],
                      reader: StoredIdReader | None = None) -> Response:
        """Relay ``request`` to ``replica``; ``on_done`` runs once its answer has been relayed
        (or failed), after ``reader``, if any, has read every chunk of it."""
        url = self.replicas.replicas[replica].base_url + request.url.path
        upstream = self.http.build_request(request.method, url, content=body, params=request.query_params,
                                           headers=_forwarded(request.headers))
        try:
            answer = await self.http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            on_done()
            return APIError(502, f"replica {replica} failed before answering: {exc!r}",
                            code="replica_failed").response()
        headers = _forwarded(answer.headers) | {"x-travelator-replica": str(replica)}
        return StreamingResponse(self._relay(answer, replica, on_done, reader), status_code=answer.status_code,
                                 headers=headers)

    async def _relay(self, answer: httpx.Response, replica: int, on_done: Callable[[], None],
                     reader: StoredIdReader | None):
        event_stream = answer.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in answer.aiter_raw():
                if reader is not None:
                    reader.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            if event_stream:
                error = APIError(502, f"replica {replica} failed mid-stream: {exc!r}",
                                 code="replica_failed").body().model_dump()
                yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            await answer.aclose()
            on_done()

    async def aclose(self) -> None:
        await self.http.aclose()
