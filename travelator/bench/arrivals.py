"""Request arrival times: a Poisson process, or a burstier gamma renewal process."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, rate: float, *, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Arrival times in seconds, the first at 0, for ``rate`` requests per second.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``:
    ``burstiness == 1`` is a Poisson process (exponential gaps); below 1 arrivals come
    in bursts (the gaps' coefficient of variation is ``1 / sqrt(burstiness)``), above 1
    they are more regular. ``rate == inf`` sends everything at once.

    The gaps of one seed are the same draws scaled by ``1 / rate``, so a sweep over
    rates replays the same pattern faster or slower.
    """
    if num_requests < 0:
        raise ValueError("num_requests must be non-negative")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_rate(text: str) -> float:
    """A request rate from the command line: a positive number or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"not a request rate: {text!r}") from None
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {text!r}")
    return rate
