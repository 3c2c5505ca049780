"""What one engine step costs, as a function of what the step computes.

A step is described by its ``StepShape``, read from the ``SchedulerOutput`` alone (the
scheduler records each request's computed tokens as the step starts), so the same shape comes
from a simulated step and from a profiled step of the real engine; ``StepHistory`` adds what
the process ran before it (a step of the same row count or not, the steps just before, idle
time). ``LinearCostModel`` is the fitted kind: seconds as a non-negative combination of the
shape's features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from travelator.engine.scheduler_output import SchedulerOutput

# The cost model file's format. 1: no version field, five shape fields per profiled step (none
# of ``StepHistory``'s), none of the terms after ``prefill_pairs`` in ``FEATURES``; it loads as
# it did (those terms cost nothing).
FORMAT_VERSION = 2
# How many steps back a shape remembers the rows of (``StepShape.recent_rows``).
RECENT_STEPS = 16
# A gap between two steps longer than this: the engine was idle (``StepShape.since_idle``).
IDLE_GAP_S = 0.01


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0  # prompt tokens (or recomputed outputs) computed this step
    decode_tokens: int = 0  # tokens of decoding requests: 1 each, plus their drafts
    decode_context: int = 0  # keys the decoding requests attend to, summed
    prefill_pairs: int = 0  # causal query-key pairs of the prefill chunks, summed
    num_requests: int = 0
    # What the process ran before the step (``StepHistory``): whether this is the first step
    # of its row count, the rows of the steps just before (the latest first), and how many
    # steps it is since the engine was idle (1: the first after it; 0: none seen idle).
    new_rows: bool = False
    recent_rows: tuple[int, ...] = ()
    since_idle: int = 0

    @property
    def rows(self) -> int:
        return self.prefill_tokens + self.decode_tokens

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


class StepHistory:
    """What a process has run, as the next step's cost depends on it:

    - the row counts of its steps: oneDNN makes (JIT-compiles) its GEMM kernels for each new
      number of rows at the first call and keeps them, so the first step of a row count costs
      more, the more so the more rows it has (a fresh engine, or a run of prompt lengths not
      seen before, pays it again and again; a process that has served a while has seen most
      counts up to its token budget);
    - the rows of the steps just before: a step that streams its weights right after one that
      took the GEMM reads them back from memory (the GEMM's copy of the weights pushed them out
      of the cache), and the next few streamed steps a share of them;
    - how long since the engine was idle: the first steps after an idle spell run slower
      (the cores and their caches were lent to other work meanwhile)."""

    def __init__(self, seen: Iterable[int] = (), recent_rows: Iterable[int] = (), since_idle: int = 0) -> None:
        self.seen: set[int] = set(seen)
        self.recent_rows = tuple(recent_rows)[:RECENT_STEPS]
        self.since_idle = since_idle

    def mark(self, shape: StepShape, idle_s: float = 0.0) -> StepShape:
        """``shape`` with what ran before it; ``idle_s``: how long the engine had nothing to
        run before it started."""
        self.since_idle = 1 if idle_s > IDLE_GAP_S else self.since_idle + bool(self.since_idle)
        marked = replace(shape, new_rows=shape.rows not in self.seen, recent_rows=self.recent_rows,
                         since_idle=self.since_idle)
        self.seen.add(shape.rows)
        self.recent_rows = (shape.rows, *self.recent_rows[:RECENT_STEPS - 1])
        return marked


class CostModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One step through a pipeline: each stage's seconds, first to last, and the send of its
    activations from one stage to the next."""

    stages: tuple[float, ...]
    send: float = 0.0

    @property
    def total(self) -> float:
        """What the step takes when no stage is busy with another: one micro-batch's time."""
        return sum(self.stages) + (len(self.stages) - 1) * self.send


@runtime_checkable
class PipelinedCostModel(CostModel, Protocol):
    """A cost model that knows a step's time per pipeline stage (the roofline): the simulator
    keeps up to ``pipeline_stages`` steps in flight on it, as the engine does."""

    @property
    def pipeline_stages(self) -> int: ...

    def stage_times(self, shape: StepShape) -> StageTimes: ...


def pipeline_stages(cost: CostModel) -> int:
    """How many stages a step passes through (1: the whole model in one, as fitted models are:
    they time whole steps of one process, which says nothing of how a split would share it)."""
    return cost.pipeline_stages if isinstance(cost, PipelinedCostModel) else 1


FEATURES = ("intercept", "large_step", "prefill_tokens", "decode_tokens", "requests", "decode_context",
            "prefill_pairs", "streamed_rows", "streamed_after_large", "after_idle", "after_idle_rows", "new_shape",
            "new_shape_rows")
# The terms of what ran before a step (``StepHistory``).
HISTORY_FEATURES = ("streamed_after_large", "after_idle", "after_idle_rows", "new_shape", "new_shape_rows")
# Row counts above which a step may take another kernel path (``large_step``), tried where the
# engine does not name its own (``profiling.route_switch_rows``): the fit keeps the one that
# explains the steps best (a CPU streams the weights of a few-row step, and multiplies larger
# ones through a GEMM that reads a wider copy).
LARGE_STEP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# Steps over which the extra cost after a large step or an idle spell fades (``recovery_steps``:
# the k-th step after it pays exp(-(k - 1) / recovery_steps) of the first one's): the fit
# keeps the one that explains the steps best.
RECOVERY_CANDIDATES = (0.5, 1.0, 2.0, 4.0)
# A step slower than its fitted time by more than this share, and by more than this many
# times the fit's median relative error, was held up by other work on the machine: dropped
# before the final fit.
DISTURBED_EXCESS = 2.0
DISTURBED_MEDIANS = 6.0


def feature_row(shape: StepShape, large_step_rows: int | None, recovery_steps: float | None = None) -> list[float]:
    rows = shape.rows
    switch = large_step_rows is not None
    large = switch and rows > large_step_rows
    streamed = rows if switch and not large else 0
    after_large = _fading(_since_large(shape, large_step_rows), recovery_steps) if streamed else 0.0
    after_idle = _fading(shape.since_idle, recovery_steps)
    new = float(shape.new_rows)
    return [1.0, float(large), shape.prefill_tokens, shape.decode_tokens, shape.num_requests, shape.decode_context,
            shape.prefill_pairs, streamed, after_large, after_idle, rows * after_idle, new, rows * new]


def _since_large(shape: StepShape, large_step_rows: int) -> int:
    """How many steps it is since the last one of more than ``large_step_rows`` rows (1: it
    ran just before; 0: none among the recent ones)."""
    return next((k + 1 for k, r in enumerate(shape.recent_rows) if r > large_step_rows), 0)


def _fading(k: int, recovery_steps: float | None) -> float:
    return 0.0 if not k or recovery_steps is None else math.exp(-(k - 1) / recovery_steps)


@dataclass(slots=True)
class LinearCostModel:
    """Seconds per step = intercept (+ ``large_step`` for steps of more than
    ``large_step_rows`` rows, which leave the streaming kernels for the GEMM, and for those
    that do not ``streamed_rows`` per row, the two routes' costs per row differing, and
    ``streamed_after_large`` after a large step, fading over ``recovery_steps``) + a cost per
    prefill token and per decode token (their rows through the layers' GEMMs), per request
    (its one row of logits and its sampling, whether it decodes or ends a prompt chunk), per
    key a decode reads and per causal pair a prefill chunk computes (+ ``after_idle`` and
    ``after_idle_rows`` per row after an idle spell, fading alike, and ``new_shape`` and
    ``new_shape_rows`` per row for the first step of a row count; see ``StepHistory``).
    Without the per-request term a decode row carries its logits' cost, and a step that adds
    decodes beside a long prompt chunk is over-predicted."""

    coefficients: dict[str, float]
    large_step_rows: int | None = None
    info: dict = field(default_factory=dict)  # where it came from: model, machine, fit error
    recovery_steps: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {FEATURES}")

    @classmethod
    def constant(cls, seconds: float) -> LinearCostModel:
        return cls({"intercept": seconds})

    def step_seconds(self, shape: StepShape) -> float:
        row = feature_row(shape, self.large_step_rows, self.recovery_steps)
        return sum(self.coefficients.get(name, 0.0) * x for name, x in zip(FEATURES, row))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "linear", "version": FORMAT_VERSION,
                                          "coefficients": self.coefficients,
                                          "large_step_rows": self.large_step_rows,
                                          "recovery_steps": self.recovery_steps, "info": self.info}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LinearCostModel:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "linear":
            raise ValueError(f"{path}: not a fitted step-cost model (kind {data.get('kind')!r})")
        if data.get("version", 1) > FORMAT_VERSION:
            raise ValueError(f"{path}: cost model format {data['version']}, newer than this travelator's "
                             f"{FORMAT_VERSION}")
        return cls(dict(data["coefficients"]), data.get("large_step_rows"), dict(data.get("info", {})),
                   data.get("recovery_steps"))


@dataclass(frozen=True, slots=True)
class ProfiledStep:
    shape: StepShape
    seconds: float

    def to_row(self) -> list:
        """As the cost model's ``info["profile"]`` and sim_validate's steps files keep it."""
        return [*astuple(self.shape), self.seconds]

    @classmethod
    def from_row(cls, row: Sequence) -> ProfiledStep:
        """A stored row: the shape's fields, then the seconds (format 1: the first five)."""
        return cls(StepShape(*(tuple(x) if isinstance(x, list) else x for x in row[:-1])), row[-1])


def fit_linear(steps: list[ProfiledStep], switch_rows: Sequence[int] = ()) -> LinearCostModel:
    """Least squares over the features, each step weighted by 1 / its time (relative error is
    what matters), for each candidate ``large_step_rows`` (``switch_rows``, the row counts at
    which the engine says its kernels change, or else none and each of
    ``LARGE_STEP_CANDIDATES``) and each of ``RECOVERY_CANDIDATES``; the best fit wins. Steps
    that other work on the machine held up (far slower than the fit) are dropped and the fit
    made again without them (found by a fit without the terms of ``StepHistory``)."""
    if len(steps) < 2 * len(FEATURES):
        raise ValueError(f"fitting needs at least {2 * len(FEATURES)} profiled steps, got {len(steps)}")
    candidates = [(t, r) for t in (tuple(switch_rows) or (None, *LARGE_STEP_CANDIDATES)) for r in RECOVERY_CANDIDATES]
    # Held-up steps are found by a fit of the shape alone: the history's terms each bear on
    # few steps, and a fit with them would bend them to explain a held-up one.
    shape_only = _best_fit(steps, candidates, HISTORY_FEATURES)
    kept = [s for s, bad in zip(steps, disturbed(shape_only, steps)) if not bad]
    model = _best_fit(kept if len(kept) >= 2 * len(FEATURES) else steps, candidates)
    model.info["disturbed_steps_dropped"] = len(steps) - len(kept)
    return model


def disturbed(model: CostModel, steps: list[ProfiledStep]) -> np.ndarray:
    """Which steps ran far slower than the model says (``DISTURBED_EXCESS``)."""
    y = np.array([s.seconds for s in steps])
    pred = np.maximum([model.step_seconds(s.shape) for s in steps], 0.5 * np.min(y))
    excess = y / pred - 1
    return excess > max(DISTURBED_EXCESS, DISTURBED_MEDIANS * float(np.median(np.abs(excess))))


def _best_fit(steps: list[ProfiledStep], candidates: Sequence[tuple[int | None, float]],
              left_out: Sequence[str] = ()) -> LinearCostModel:
    y = np.array([s.seconds for s in steps])
    out = [FEATURES.index(name) for name in left_out]
    fits = []
    for t, r in candidates:
        x = np.array([feature_row(s.shape, t, r) for s in steps])
        x[:, out] = 0.0
        fits.append(_fit_nonnegative(x, y, t, r))
    return min(fits, key=lambda f: f[1])[0]


def _fit_nonnegative(x: np.ndarray, y: np.ndarray, large_step_rows: int | None,
                     recovery_steps: float) -> tuple[LinearCostModel, float]:
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
    model = LinearCostModel({FEATURES[a]: float(max(c, 0.0)) for a, c in zip(active, coef)}, large_step_rows,
                            recovery_steps=recovery_steps)
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
