"""``POST /v1/embeddings``, ``/v1/score`` and ``/v1/rerank``: prompt-only requests.

Each input (or query-document pair) becomes one engine request with ``max_tokens=0`` and
pooling parameters (pooling_params.py): its prompt is chunked and batched with everything
else, so embeddings and scores never hold up decodes beyond their share of a step's tokens.
An embedding is the final hidden states pooled (``--pooling last|mean``), normalised; a score
is the first label's share of the labels' probability after a yes/no prompt (scoring.py).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from travelator.engine.outputs import RequestOutput
from travelator.pooling_params import PoolingParams
from travelator.scoring import relevance
from travelator.server.body import read_body
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.pooling_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    PromptUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    Score,
    ScoreRequest,
    ScoreResponse,
)
from travelator.server.protocol import now
from travelator.server.serving import EnginePrompt, OpenAIServing
from travelator.server.streaming import json_response


def pooling_routes(serving: OpenAIServing, require_api_key) -> APIRouter:
    limit, preprocessor = serving.settings.max_body_bytes, serving.preprocessor
    router = APIRouter(dependencies=[Depends(require_api_key)])

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await read_body(request, EmbeddingRequest, limit, preprocessor)
        return await create_embeddings(serving, req, request)

    @router.post("/v1/score")
    @router.post("/score")
    async def score(request: Request) -> Response:
        req = await read_body(request, ScoreRequest, limit, preprocessor)
        return await create_score(serving, req, request)

    @router.post("/v1/rerank")
    @router.post("/rerank")
    @router.post("/v2/rerank")
    async def rerank(request: Request) -> Response:
        req = await read_body(request, RerankRequest, limit, preprocessor)
        return await create_rerank(serving, req, request)

    return router


async def _run(serving: OpenAIServing, request: Request, gen: Generation) -> list[RequestOutput] | None:
    serving.launch(gen)
    return await serving.collect(request, gen, len(gen.request_ids), lambda i, out: None)


# ---- embeddings ---------------------------------------------------------------------------
async def create_embeddings(serving: OpenAIServing, req: EmbeddingRequest, request: Request) -> Response:
    model = serving.resolve_model(req.model)
    pooling = PoolingParams("embed", serving.settings.pooling, dimensions=_dimensions(serving, req.dimensions))
    gen = await serving.preprocessor.run(_prepare_embeddings, serving, req, pooling)
    finals = await _run(serving, request, gen)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    data = [Embedding(index=i, embedding=_encoded(out.pooled, req.encoding_format)) for i, out in enumerate(finals)]
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    return json_response(EmbeddingResponse(data=data, model=model,
                                           usage=PromptUsage(prompt_tokens=tokens, total_tokens=tokens)))


def _dimensions(serving: OpenAIServing, dimensions: int | None) -> int | None:
    """A length the model's embeddings may be cut to, or a 400 naming ``dimensions``."""
    full, allowed = serving.model.hidden_size, serving.model.matryoshka_dimensions
    if dimensions is None or dimensions == full:
        return None
    if dimensions in allowed:
        return dimensions
    choices = ", ".join(map(str, sorted({*allowed, full})))
    raise APIError(400, f"dimensions must be one of {choices} for this model (its embeddings "
                        f"are {full} long{'' if allowed else ' and not trained to be cut shorter'})",
                   param="dimensions")


def _prepare_embeddings(serving: OpenAIServing, req: EmbeddingRequest, pooling: PoolingParams) -> Generation:
    inputs = req.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input is empty", param="input")
    _check_count(serving, len(inputs), "input")
    prompts = []
    for i, item in enumerate(inputs):
        ids = serving.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not item or not ids:
            raise APIError(400, f"input[{i}] is empty", param="input")
        prompts.append(EnginePrompt(item if isinstance(item, str) else None, ids))
    return serving.prepare_prompt_only(prompts, pooling, req.priority, "input", "embd")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _check_count(serving: OpenAIServing, count: int, param: str) -> None:
    limit = serving.settings.max_embedding_inputs
    if count > limit:
        raise APIError(400, f"{count} inputs in one request, more than this server's limit of {limit}",
                       param=param)


# ---- scores -------------------------------------------------------------------------------
async def create_score(serving: OpenAIServing, req: ScoreRequest, request: Request) -> Response:
    model = serving.resolve_model(req.model)
    gen = await serving.preprocessor.run(_prepare_scores, serving, _score_pairs(req), req.priority, "text_2")
    scores = await _scores(serving, request, gen)
    if scores is None:
        return Response(status_code=499)
    values, tokens = scores
    return json_response(ScoreResponse(
        id=gen.id, created=now(), model=model, data=[Score(index=i, score=s) for i, s in enumerate(values)],
        usage=PromptUsage(prompt_tokens=tokens, total_tokens=tokens)))


async def create_rerank(serving: OpenAIServing, req: RerankRequest, request: Request) -> Response:
    model = serving.resolve_model(req.model)
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {req.top_n}", param="top_n")
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    if not texts:
        raise APIError(400, "documents is empty", param="documents")
    gen = await serving.preprocessor.run(_prepare_scores, serving, [(req.query, t) for t in texts],
                                         req.priority, "documents")
    scores = await _scores(serving, request, gen)
    if scores is None:
        return Response(status_code=499)
    values, tokens = scores
    best = sorted(range(len(texts)), key=lambda i: -values[i])[:req.top_n]
    results = [RerankResult(index=i, relevance_score=values[i],
                            document=RerankDocument(text=texts[i]) if req.return_documents else None)
               for i in best]
    return json_response(RerankResponse(id=gen.id, model=model, results=results,
                                        usage=RerankUsage(total_tokens=tokens)))


def _score_pairs(req: ScoreRequest) -> list[tuple[str, str]]:
    """text_1 against each text_2 (one text_1), or text_1[i] against text_2[i]."""
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not first or not second:
        raise APIError(400, "text_1 and text_2 must each hold at least one text",
                       param="text_1" if not first else "text_2")
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                            f"or as many as text_2", param="text_1")
    return list(zip(first, second))


def _prepare_scores(serving: OpenAIServing, pairs: list[tuple[str, str]], priority: int,
                    param: str) -> Generation:
    _check_count(serving, len(pairs), param)
    fmt = serving.settings.score_format
    try:
        labels = fmt.label_token_ids(serving.tokenizer)
    except ValueError as exc:
        raise APIError(400, f"this server cannot score: {exc} (start it with --score-labels)",
                       code="score_labels_unsupported") from None
    prompts = [EnginePrompt(None, fmt.prompt_token_ids(serving.tokenizer, q, d)) for q, d in pairs]
    return serving.prepare_prompt_only(prompts, PoolingParams("score", label_token_ids=labels), priority,
                                       param, "score")


async def _scores(serving: OpenAIServing, request: Request, gen: Generation) -> tuple[list[float], int] | None:
    finals = await _run(serving, request, gen)
    if finals is None:
        return None
    return [relevance(out.pooled) for out in finals], sum(len(out.prompt_token_ids) for out in finals)
