"""What an operator sets about the HTTP server (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ServerSettings:
    # Names clients may put in "model"; the first is the one reported. Empty: the engine's model name.
    served_model_names: list[str] = field(default_factory=list)
    # Bearer token required on /v1/*; None: no authentication.
    api_key: str | None = None
    # Past this many requests waiting for the engine, new ones get 503.
    max_waiting: int = 256
    # Most choices per prompt (n), and most prompts x n in one request.
    max_n: int = 16
    max_choices_per_request: int = 256
    # Largest request body accepted (413 past it).
    max_body_bytes: int = 4 << 20
    # On SIGTERM: stop accepting, let in-flight requests run this long, then abort them.
    shutdown_grace_s: float = 10.0

    def validate(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.max_choices_per_request < self.max_n:
            raise ValueError("max_choices_per_request must be at least max_n")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be non-negative, got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
