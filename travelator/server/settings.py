"""What an operator sets about the HTTP server (the engine has its own EngineConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from travelator.pooling_params import POOLING_METHODS
from travelator.sampling_params import StopLimits
from travelator.scoring import ScoreFormat


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _env_float(name: str) -> float | None:
    value = os.environ.get(name, "").strip()
    return float(value) if value else None


@dataclass(slots=True)
class ServerSettings:
    # Names clients may put in "model"; the first is the one reported. Empty: the engine's model name.
    served_model_names: list[str] = field(default_factory=list)
    # Bearer token required on /v1/*; None: no authentication.
    api_key: str | None = None
    # Past this many requests waiting for the engine, new ones get 503. None: no limit (as
    # vLLM): benchmark clients open hundreds of streams at once and expect them queued.
    max_waiting: int | None = None
    # Most choices per prompt (n), and most prompts x n in one request.
    max_n: int = 16
    max_choices_per_request: int = 256
    # Largest request body accepted (413 past it).
    max_body_bytes: int = 4 << 20
    # Most stop strings, characters per stop string and stop token ids per request (400 past
    # them); see StopLimits for the defaults.
    stop_limits: StopLimits = field(default_factory=StopLimits)
    # The priorities clients may ask for (lower runs first under --scheduling-policy
    # priority); others get 400.
    priority_range: tuple[int, int] = (-1000, 1000)
    # On SIGTERM: stop accepting, let in-flight requests run this long, then abort them.
    shutdown_grace_s: float = 10.0
    # GET /debug/engine: the engine's own accounting (KV blocks and who holds them, queues, the
    # pool's consistency check), read between two steps. Off unless asked for; the environment
    # variable TRAVELATOR_DEBUG_ENDPOINTS=1 turns it on for `travelator serve`.
    enable_debug_endpoints: bool = field(default_factory=lambda: _env_flag("TRAVELATOR_DEBUG_ENDPOINTS"))
    # A step running longer than this makes /health answer 503 and the server exit non-zero
    # (the loop is stuck). None: never. Environment: TRAVELATOR_STEP_TIMEOUT_S.
    step_timeout_s: float | None = field(default_factory=lambda: _env_float("TRAVELATOR_STEP_TIMEOUT_S"))
    # CORS, for browser clients: origins allowed to call the server (e.g. "https://ui.example"
    # or "*"). Empty: no CORS headers at all, so nothing is opened by accident. The methods
    # and headers apply only when some origin is allowed.
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    # Structured outputs: a constraint (schema, regex, grammar, forced tool call) compiles on a
    # worker thread before its request reaches the engine; past this many seconds the request
    # gets a 400. Compiled grammars are kept for later requests that use the same one.
    grammar_compile_timeout_s: float = 10.0
    # The largest constraint compiled (its JSON as sent, bytes): a 400 past it, before any work.
    # A compile cannot be stopped once started, and its time grows faster than its size
    # (docs/design.md, Structured outputs), so the size bound is what keeps a few huge schemas
    # from holding both compile threads for minutes.
    max_constraint_bytes: int = 256 << 10
    # The longest number a JSON constraint lets a model write (json_grammar.NumberLimits):
    # digits in its integer and fraction parts together, and in its exponent.
    json_number_digits: int = 17
    json_exponent_digits: int = 3
    # How tool calls are read out of a model's text with tool_choice "auto": "hermes"
    # (<tool_call>{...}</tool_call>), "llama3_json" ({"name": ..., "parameters": ...}), or
    # "auto": from the chat template (Hermes tags where it has them).
    tool_call_parser: str = "auto"
    # GET /dashboard, the live view, and its stream /dashboard/stream (needing the API key when
    # there is one). Prompts' text is shown there only when allowed.
    dashboard: bool = True
    dashboard_show_prompts: bool = False
    # /v1/embeddings: how a prompt's final hidden states become one vector ("last": the last
    # token's, "mean": the mean of every token's), and the most inputs in one request (OpenAI's).
    pooling: str = "last"
    max_embedding_inputs: int = 2048
    # /v1/score and /v1/rerank: the yes/no prompt and its labels (scoring.py).
    score_format: ScoreFormat = field(default_factory=ScoreFormat)
    # Responses kept for previous_response_id and GET/DELETE /v1/responses/{id} (store: true),
    # in this process's memory: at most this many, of at most this many bytes (as JSON) in
    # all, least recently used out first; each for at most this many seconds.
    response_store_max_count: int = 1000
    response_store_max_bytes: int = 64 << 20
    response_store_ttl_s: float = 3600.0

    def validate(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.max_choices_per_request < self.max_n:
            raise ValueError("max_choices_per_request must be at least max_n")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        self.stop_limits.validate()
        if self.priority_range[0] > self.priority_range[1]:
            raise ValueError(f"priority_range must be (low, high) with low <= high, got {self.priority_range}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be non-negative, got {self.shutdown_grace_s}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s}")
        if self.max_constraint_bytes < 1024:
            raise ValueError(f"max_constraint_bytes must be at least 1024, got {self.max_constraint_bytes}")
        if self.json_number_digits < 1 or self.json_exponent_digits < 1:
            raise ValueError("json_number_digits and json_exponent_digits must be at least 1")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ValueError(f"unknown tool_call_parser {self.tool_call_parser!r}; use auto, hermes or llama3_json")
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"unknown pooling {self.pooling!r}; use {' or '.join(POOLING_METHODS)}")
        if self.max_embedding_inputs < 1:
            raise ValueError(f"max_embedding_inputs must be at least 1, got {self.max_embedding_inputs}")
        if self.response_store_max_count < 0 or self.response_store_max_bytes < 0:
            raise ValueError("the response store's bounds must be non-negative (0: store nothing)")
        if not self.response_store_ttl_s > 0:
            raise ValueError(f"response_store_ttl_s must be positive, got {self.response_store_ttl_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
