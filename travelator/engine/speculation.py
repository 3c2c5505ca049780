"""Speculative decoding's scheduler side: proposing draft tokens (n-gram prompt lookup) and
choosing how many to verify per request and step. Plain Python, no torch.

A decoding request with k drafts computes k + 1 query tokens in the step (its last sampled
token and the drafts), as a short prompt chunk would; the runner samples at every one of them
and keeps the drafts up to the first one its own sample disagrees with, plus that sample. For
a greedy request that is the argmax; for a sampled one the same draw (same seeded noise) it
would have made without drafts, so speculation never changes what a request generates, only
how many of its tokens one step yields.

How many drafts: a draft is worth verifying when the chance that it is accepted beats what an
extra row costs the step, as a share of the step. The chance of the j-th draft is estimated as
``a**j``, ``a`` the request's measured acceptance rate (counted even while it does not
speculate: the proposal is compared with the token it then samples, for free). The cost comes
from the engine's own step times: ``StepCost`` fits ``time = fixed + per_row * rows`` over
recent steps, and one more row of a step of R rows costs the share ``per_row * R / (fixed +
per_row * R)`` of it (small while a step mostly streams the weights, near 1 once it is bound
by compute or by per-row work). Until the fit has seen steps of different sizes the share is
taken as ``running / saturation_rows``; from ``saturation_rows`` running requests on nobody
speculates.
"""

from __future__ import annotations

from collections.abc import Sequence

from travelator.engine.request import Request


def ngram_proposal(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the (up to) ``k`` tokens that followed the latest earlier occurrence of
    the longest suffix of ``tokens``, trying suffixes of ``n_max`` down to ``n_min`` tokens."""
    return lookup(as_text(tokens), n_min, n_max, k)


def lookup(text: str, n_min: int, n_max: int, k: int) -> list[int]:
    """``ngram_proposal`` on tokens written as characters (``as_text``): str.rfind does the
    search in C."""
    length = len(text)
    if k <= 0 or length < 2:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        at = text.rfind(text[length - n:], 0, length - 1)
        if at >= 0:
            return [ord(c) for c in text[at + n:at + n + k]]
    return []


def as_text(tokens: Sequence[int]) -> str:
    return "".join(map(chr, tokens))


class StepCost:
    """Step time against the rows (tokens) a step computed, fitted online by least squares
    over recent steps, older ones fading: ``time = fixed + per_row * rows``."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._seen = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._seen += 1
        d = self.decay
        self._n = self._n * d + 1
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def row_share(self, rows: int) -> float | None:
        """What share of a step of ``rows`` rows grows with its rows; None until steps of
        clearly different sizes were seen."""
        if self._seen < 8:
            return None
        mean_x = self._x / self._n
        var_x = self._xx / self._n - mean_x * mean_x
        if var_x < max(1.0, 0.01 * mean_x * mean_x):
            return None
        per_row = max((self._xy / self._n - mean_x * self._y / self._n) / var_x, 0.0)
        fixed = max(self._y / self._n - per_row * mean_x, 0.0)
        total = fixed + per_row * rows
        return per_row * rows / total if total > 0 else None


class Speculator:
    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int, adaptive: bool,
                 saturation_rows: int, by_model: bool = False) -> None:
        # by_model: a draft model in the runner proposes (the scheduler only decides how many).
        self.by_model = by_model
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.adaptive = adaptive
        self.saturation_rows = saturation_rows
        self.cost = StepCost()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Requests that may speculate: those not opted out."""
        return req.sampling_params.speculate

    def saturated(self, num_running: int) -> bool:
        """Whether the batch is so large that nobody speculates (nor probes)."""
        return self.adaptive and num_running >= self.saturation_rows

    def length(self, req: Request, num_running: int) -> int:
        """How many drafts ``req`` verifies this step, with ``num_running`` requests running."""
        if not self.adaptive:
            return self.num_tokens
        if num_running >= self.saturation_rows:
            return 0
        share = self.cost.row_share(num_running)
        threshold = num_running / self.saturation_rows if share is None else share
        a = req.speculation.acceptance
        k = 0
        while k < self.num_tokens and a ** (k + 1) > threshold:
            k += 1
        # A draft model's acceptance is seen only when it drafts: keep one draft to measure it.
        return max(k, 1) if self.by_model else k

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``limit`` drafts for a decoding request (the lookup's full length, so a
        request that does not speculate still has a proposal to probe with)."""
        # The request's tokens as characters, extended as it grows (tokens only ever append
        # while it runs).
        known = len(req.speculation_text)
        if known < req.num_tokens:
            req.speculation_text += as_text(req.token_slice(known, req.num_tokens))
        return lookup(req.speculation_text, self.ngram_min, self.ngram_max, limit)
