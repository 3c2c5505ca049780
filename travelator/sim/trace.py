"""A workload from a trace file: one request per CSV row, with its arrival time.

Columns (a header row names them): ``arrival_s``, ``prompt_tokens``, ``output_tokens``, and
optionally ``prefix_id`` and ``prefix_tokens``: requests with the same prefix id begin with
the same ``prefix_tokens`` token ids (a shared system prompt, which the prefix cache can
serve), the rest of each prompt its own. Token ids are drawn from a seed: the engine's cost
depends on how many there are and which are shared, not on which they are.
"""

from __future__ import annotations

import csv
import zlib
from pathlib import Path

import numpy as np

from travelator.bench.workloads import FIRST_PROMPT_TOKEN_ID, RequestSpec, Workload

REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")


def load_trace(path: str | Path, vocab_size: int, seed: int = 0) -> tuple[Workload, np.ndarray]:
    """The trace's requests, sorted by arrival, and their arrival times (s)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: the trace lacks the column(s) {', '.join(missing)}")
        rows = [_parse_row(row, i + 2, path) for i, row in enumerate(reader)]
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    rows.sort(key=lambda r: r[0])
    rng = np.random.default_rng(seed)
    low = FIRST_PROMPT_TOKEN_ID if vocab_size > FIRST_PROMPT_TOKEN_ID + 1 else 0
    longest: dict[str, int] = {}
    for *_, prefix_id, prefix_len in rows:
        if prefix_id:
            longest[prefix_id] = max(longest.get(prefix_id, 0), prefix_len)
    # Uses of one prefix id with different lengths share its leading tokens.
    prefixes = {pid: _prefix(pid, seed, low, vocab_size, n) for pid, n in longest.items()}
    requests = []
    for _, prompt, output, prefix_id, prefix_len in rows:
        ids = prefixes[prefix_id][:prefix_len] if prefix_id else []
        ids = ids + rng.integers(low, vocab_size, size=prompt - len(ids)).tolist()
        requests.append(RequestSpec(ids, output))
    arrivals = np.array([r[0] for r in rows]) - rows[0][0]
    return Workload("trace", seed, requests, {"path": str(path), "vocab_size": vocab_size}), arrivals


def _prefix(prefix_id: str, seed: int, low: int, vocab_size: int, length: int) -> list[int]:
    rng = np.random.default_rng([seed, zlib.crc32(prefix_id.encode())])
    return rng.integers(low, vocab_size, size=length).tolist()


def _parse_row(row: dict, line: int, path) -> tuple[float, int, int, str, int]:
    try:
        arrival = float(row["arrival_s"])
        prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
        prefix_id = (row.get("prefix_id") or "").strip()
        prefix_len = int(row.get("prefix_tokens") or 0)
    except ValueError as e:
        raise ValueError(f"{path}:{line}: {e}") from None
    if arrival < 0 or prompt < 1 or output < 1 or not 0 <= prefix_len <= prompt:
        raise ValueError(f"{path}:{line}: need arrival_s >= 0, prompt_tokens >= 1, output_tokens >= 1 "
                         "and 0 <= prefix_tokens <= prompt_tokens")
    if prefix_len and not prefix_id:
        raise ValueError(f"{path}:{line}: prefix_tokens without a prefix_id")
    return arrival, prompt, output, prefix_id, prefix_len
