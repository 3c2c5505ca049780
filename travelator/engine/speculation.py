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
from the engine's own step times: ``StepCost`` fits ``time = fixed + per_request * requests
+ per_row * rows`` over recent steps that computed no prompt (a draft adds a row, not a
request), and a draft must be accepted with probability above ``per_row * R / time`` for a
step of R decodes to yield more tokens per second with it (small while a step mostly streams
the weights, near 1 once it is bound by compute). Until the fit has seen steps of different
shapes the share is taken as ``running / saturation_rows``; from ``saturation_rows`` running
requests on nobody speculates.
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
    """Decode steps' time against the requests and the rows (tokens) they computed, fitted
    online by least squares over recent steps, older ones fading:
    ``time = fixed + per_request * requests + per_row * rows``. A draft adds a row but not a
    request: it shares its request's pass over the KV cache, its sampling call, its Python."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._seen = 0
        # Faded sums of x x^T and x y for x = (1, requests, rows).
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3

    def observe(self, requests: int, rows: int, seconds: float) -> None:
        self._seen += 1
        x = (1.0, float(requests), float(rows))
        for i in range(3):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed, per_request, per_row), or None until steps of clearly different shapes
        were seen (with rows always equal to requests the two cannot be told apart)."""
        if self._seen < 8:
            return None
        m, v = self._xx, self._xy
        det = _det3(m)
        scale = m[0][0] * m[1][1] * m[2][2]
        if scale <= 0 or abs(det) < 1e-6 * scale:
            return None
        coef = []
        for col in range(3):
            replaced = [[v[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]
            coef.append(_det3(replaced) / det)
        fixed, per_request, per_row = (max(c, 0.0) for c in coef)
        return fixed, per_request, per_row

    def draft_share(self, requests: int) -> float | None:
        """One draft row's cost against what a step of ``requests`` decodes yields per
        request-token: ``per_row * requests / time``, the acceptance a draft needs to pay."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_request, per_row = fit
        total = fixed + (per_request + per_row) * requests
        return per_row * requests / total if total > 0 else None


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def record_speculation(req: Request, num_drafts: int, first_token: int, num_accepted: int) -> None:
    """Drafts verified (or the step's free probe): how many the request's samples took."""
    if num_drafts:
        req.speculation.record(num_drafts, num_accepted)
    elif req.speculation_probe is not None:
        req.speculation.record(1, int(first_token == req.speculation_probe))
    req.speculation_probe = None


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
        if self.saturated(num_running):
            return 0
        share = self.cost.draft_share(num_running)
        threshold = num_running / self.saturation_rows if share is None else share
        a = req.speculation.acceptance
        k = 0
        while k < self.num_tokens and a ** (k + 1) > threshold:
            k += 1
        # A draft model's acceptance is seen only when it drafts: keep one draft to measure it.
        return max(k, 1) if self.by_model else k

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``limit`` drafts for a decoding request (at least one is asked for even when
        it does not speculate: its probe)."""
        # The request's tokens as characters, extended as it grows (tokens only ever append
        # while it runs).
        known = len(req.speculation_text)
        if known < req.num_tokens:
            req.speculation_text += as_text(req.token_slice(known, req.num_tokens))
        return lookup(req.speculation_text, self.ngram_min, self.ngram_max, limit)
