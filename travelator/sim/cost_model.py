"""What one engine step costs, as a function of what the step computes.

A step is described by its ``StepShape``, read from the ``SchedulerOutput`` alone (the
scheduler records each request's computed tokens as the step starts), so the same shape comes
from a simulated step and from a profiled step of the real engine. ``LinearCostModel`` is the
fitted kind: seconds as a non-negative combination of the shape's features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from travelator.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0  # prompt tokens (or recomputed outputs) computed this step
    decode_tokens: int = 0  # tokens of decoding requests: 1 each, plus their drafts
    decode_context: int = 0  # keys the decoding requests attend to, summed
    prefill_pairs: int = 0  # causal query-key pairs of the prefill chunks, summed
    num_requests: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        computed = {r.request_id: r.num_computed_tokens for r in out.new_requests}
        computed.update({r.request_id: r.num_computed_tokens for r in out.cached_requests})
        prefilling = set(out.prefill_request_ids)
        prefill = decode = context = pairs = 0
        for rid, n in out.num_scheduled_tokens.items():
            c = computed[rid]
            if rid in prefilling:
                prefill += n
                pairs += n * c + n * (n + 1) // 2
            else:
                decode += n
                context += c + n
        return cls(prefill, decode, context, pairs, len(out.num_scheduled_tokens))


class CostModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


FEATURES = ("intercept", "large_step", "prefill_tokens", "decode_tokens", "requests", "decode_context",
            "prefill_pairs")
# Row counts above which a step may take another kernel path (``large_step``): the fit keeps the
# one that explains the steps best (a CPU streams the weights of a few-row step, and multiplies
# larger ones through a GEMM that reads a wider copy).
LARGE_STEP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def feature_row(shape: StepShape, large_step_rows: int | None) -> list[float]:
    rows = shape.prefill_tokens + shape.decode_tokens
    large = float(large_step_rows is not None and rows > large_step_rows)
    return [1.0, large, shape.prefill_tokens, shape.decode_tokens, shape.num_requests, shape.decode_context,
            shape.prefill_pairs]


@dataclass(slots=True)
class LinearCostModel:
    """Seconds per step = intercept (+ ``large_step`` for steps of more than
    ``large_step_rows`` rows) + a cost per prefill token and per decode token (their rows
    through the layers' GEMMs), per request (its one row of logits and its sampling, whether
    it decodes or ends a prompt chunk), per key a decode reads and per causal pair a prefill
    chunk computes. Without the per-request term a decode row carries its logits' cost, and a
    step that adds decodes beside a long prompt chunk is over-predicted."""

    coefficients: dict[str, float]
    large_step_rows: int | None = None
    info: dict = field(default_factory=dict)  # where it came from: model, machine, fit error

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {FEATURES}")

    @classmethod
    def constant(cls, seconds: float) -> LinearCostModel:
        return cls({"intercept": seconds})

    def step_seconds(self, shape: StepShape) -> float:
        row = feature_row(shape, self.large_step_rows)
        return sum(self.coefficients.get(name, 0.0) * x for name, x in zip(FEATURES, row))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "linear", "coefficients": self.coefficients,
                                          "large_step_rows": self.large_step_rows, "info": self.info},
                                         indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LinearCostModel:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "linear":
            raise ValueError(f"{path}: not a fitted step-cost model (kind {data.get('kind')!r})")
        return cls(dict(data["coefficients"]), data.get("large_step_rows"), dict(data.get("info", {})))


@dataclass(frozen=True, slots=True)
class ProfiledStep:
    shape: StepShape
    seconds: float


def fit_linear(steps: list[ProfiledStep]) -> LinearCostModel:
    """Least squares over the features, each step weighted by 1 / its time (relative error is
    what matters), for each candidate ``large_step_rows``; the best fit wins."""
    if len(steps) < 2 * len(FEATURES):
        raise ValueError(f"fitting needs at least {2 * len(FEATURES)} profiled steps, got {len(steps)}")
    y = np.array([s.seconds for s in steps])
    fits = [_fit_nonnegative(np.array([feature_row(s.shape, t) for s in steps]), y, t)
            for t in (None, *LARGE_STEP_CANDIDATES)]
    return min(fits, key=lambda f: f[1])[0]


def _fit_nonnegative(x: np.ndarray, y: np.ndarray, large_step_rows: int | None) -> tuple[LinearCostModel, float]:
    """Keeping every coefficient non-negative (more work never costs less time): a feature whose
    best weight comes out negative is dropped and the rest refitted. Steps are weighted by
    1 / their predicted time from an unweighted first pass: weighting by the measured time
    instead would favour the steps that happened to run fast (a step delayed by other work on
    the machine would count for less), and bias every prediction low. Returns the model and
    its weighted residual."""
    active = [a for a in range(len(FEATURES)) if np.any(x[:, a])]
    (first_active, first_coef), _ = _nonnegative_lstsq(x, y, np.ones_like(y), active)
    w = 1.0 / np.maximum(x[:, first_active] @ first_coef, 0.5 * np.min(y))
    (active, coef), residual = _nonnegative_lstsq(x, y, w, active)
    model = LinearCostModel({FEATURES[a]: float(max(c, 0.0)) for a, c in zip(active, coef)}, large_step_rows)
    return model, residual


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray,
                       active: list[int]) -> tuple[tuple[list[int], np.ndarray], float]:
    active = list(active)
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [a for a, c in zip(active, coef) if c < 0 and a != 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda a: coef[active.index(a)]))
    return (active, coef), float(np.sum(((x[:, active] @ coef - y) * w) ** 2))


def relative_errors(model: CostModel, steps: list[ProfiledStep]) -> np.ndarray:
    """|predicted - measured| / measured, per step."""
    pred = np.array([model.step_seconds(s.shape) for s in steps])
    meas = np.array([s.seconds for s in steps])
    return np.abs(pred - meas) / meas
