"""Request and response bodies of the prompt-only endpoints: ``/v1/embeddings`` (OpenAI's
shape), ``/v1/score`` (vLLM's) and ``/v1/rerank`` (Jina's and Cohere's, as vLLM serves it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictStr

from travelator.server.protocol import TokenIds


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    user: str | None = None
    priority: int = 0  # as on the generation endpoints (lower runs first under priority scheduling)


class EmbeddingRequest(_Body):
    # A string, a batch of strings, one list of token ids, or a batch of them.
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # float: the numbers; base64: their little-endian float32 bytes (what the openai SDK asks for).
    embedding: list[float] | str


class PromptUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: PromptUsage


class ScoreRequest(_Body):
    """One text_1 against every text_2, or pairs of equal-length lists (vLLM's /score)."""

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]


class Score(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: PromptUsage


class RerankDocumentObject(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    text: StrictStr


class RerankRequest(_Body):
    query: StrictStr
    documents: list[StrictStr | RerankDocumentObject]
    top_n: int | None = None  # the best this many; None: all
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: RerankUsage
