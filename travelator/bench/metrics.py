"""Per-request timings and the summary metrics serving benchmarks report.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

- TTFT: time to first token, from the request's arrival (send time) to its first token.
- E2E: end-to-end latency, from arrival to the last token.
- TPOT: time per output token after the first, ``(E2E - TTFT) / (output_len - 1)``,
  one value per request with at least two output tokens.
- ITL: inter-token latency, every gap between consecutive token events of a request,
  pooled over all requests (a streamed chunk that carries several tokens is one event).
- Normalised latency (Orca's metric): ``E2E / output_len`` in seconds per token.
- Throughput: completed requests, output tokens and prompt + output tokens per second of
  the benchmark's duration (from its start to the last completion).
- Goodput: completed requests per second that met every SLO given (TTFT, TPOT, E2E and
  ITL limits in milliseconds; a request meets the ITL limit when all its gaps do).

Percentiles use numpy's default (linear interpolation between order statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el", "itl")
_SLO_ALIASES = {"e2e": "e2el", "e2el": "e2el", "ttft": "ttft", "tpot": "tpot", "itl": "itl"}


@dataclass(slots=True)
class RequestResult:
    """What one request did; times in seconds since the benchmark started."""

    prompt_len: int
    expected_output_len: int
    arrival: float  # when it was sent (or meant to arrive, offline)
    token_times: list[float] = field(default_factory=list)  # one per token event
    end: float | None = None
    output_len: int = 0  # output tokens received
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def normalized_latency(self) -> float | None:
        if self.e2e is None or self.output_len < 1:
            return None
        return self.e2e / self.output_len


def parse_slo(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds) -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    slo: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep:
            key, sep, value = item.partition("=")
        name = _SLO_ALIASES.get(key.strip().lower())
        if not sep or name is None:
            raise ValueError(
                f"bad SLO {item!r}: expected KEY:MILLISECONDS with KEY one of ttft, tpot, e2el, itl")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number") from None
        if not ms > 0:
            raise ValueError(f"bad SLO {item!r}: the limit must be positive")
        slo[name] = ms
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    checks = {
        "ttft": [r.ttft],
        "tpot": [r.tpot] if r.tpot is not None else [],
        "e2el": [r.e2e],
        "itl": r.itls,
    }
    for key, limit_ms in slo.items():
        for v in checks[key]:
            if v is None or v * 1000 > limit_ms:
                return False
    return True


def _stats(name: str, values, scale: float, unit: str, out: dict,
           percentiles=PERCENTILES) -> None:
    a = np.asarray([v for v in values if v is not None], dtype=float) * scale
    keys = [f"mean_{name}_{unit}", f"median_{name}_{unit}", f"std_{name}_{unit}"]
    keys += [f"p{p}_{name}_{unit}" for p in percentiles]
    if a.size == 0:
        out.update({k: None for k in keys})
        return
    out[keys[0]] = float(a.mean())
    out[keys[1]] = float(np.median(a))
    out[keys[2]] = float(a.std())
    for p, k in zip(percentiles, keys[3:]):
        out[k] = float(np.percentile(a, p))


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slo: dict[str, float] | None = None,
                    percentiles=PERCENTILES) -> dict:
    """Summary metrics over the requests of one run (a flat dict, JSON-ready)."""
    ok = [r for r in results if r.success]
    m: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
    }
    d = duration_s if duration_s > 0 else float("nan")
    m["request_throughput"] = len(ok) / d
    m["output_throughput"] = m["total_output_tokens"] / d
    m["total_token_throughput"] = (m["total_input_tokens"] + m["total_output_tokens"]) / d
    _stats("ttft", [r.ttft for r in ok], 1000, "ms", m, percentiles)
    _stats("tpot", [r.tpot for r in ok], 1000, "ms", m, percentiles)
    _stats("itl", [g for r in ok for g in r.itls], 1000, "ms", m, percentiles)
    _stats("e2el", [r.e2e for r in ok], 1000, "ms", m, percentiles)
    _stats("norm_latency", [r.normalized_latency for r in ok], 1, "s_per_token", m, percentiles)
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        m["slo_ms"] = dict(slo)
        m["good_requests"] = good
        m["goodput"] = good / d
    return m


def format_metrics(m: dict, title: str = "Benchmark result", width: int = 50) -> str:
    """A readable block in the style of vLLM's serving benchmark."""
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value, fmt: str = "{:.2f}") -> None:
        if value is None:
            text = "n/a"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = fmt.format(value)
        lines.append(f"{label:<{width - 14}}{text:>14}")

    row("Successful requests:", m["completed"])
    if m.get("failed"):
        row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if "goodput" in m:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in m["slo_ms"].items())
        row(f"Goodput (req/s) [{slo}]:", m["goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^{width}}")
        row(f"Mean {name.upper()} (ms):", m.get(f"mean_{name}_ms"))
        row(f"Median {name.upper()} (ms):", m.get(f"median_{name}_ms"))
        for p in PERCENTILES[1:]:
            if f"p{p}_{name}_ms" in m:
                row(f"P{p} {name.upper()} (ms):", m.get(f"p{p}_{name}_ms"))
    lines.append(f"{' Normalised latency (Orca) ':-^{width}}")
    row("Median (s/token):", m.get("median_norm_latency_s_per_token"), "{:.4f}")
    row("Mean (s/token):", m.get("mean_norm_latency_s_per_token"), "{:.4f}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain text table. ``columns``: (header, key, format) triples."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        line = []
        for _, key, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else (fmt.format(v) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(s.rjust(w) for s, w in zip(c, widths)))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "| " + " | ".join("---:" for _ in columns) + " |"
    body = []
    for r in rows:
        vals = []
        for _, key, fmt in columns:
            v = r.get(key)
            vals.append("-" if v is None else (fmt.format(v) if fmt else str(v)))
        body.append("| " + " | ".join(vals) + " |")
    return "\n".join([head, sep, *body])
