"""The interference experiment: what a long prompt does to the requests already decoding.

A few requests decode steadily (short prompts, long outputs, all present at the start);
long prompts arrive now and then while they run. Every batching mode serves the same
requests on the same arrival times, with the same model, kernels and token budget:

- Orca's whole-prompt scheduling computes a joining prompt in one step, so every running
  decode waits for that step: one long gap between two of its tokens (a stall).
- Chunked prefill (Sarathi-Serve) splits the prompt over several steps within the token
  budget: the decodes keep producing a token every step, each step a little longer.
- Static and dynamic batching never let the long prompt into the running batch: the
  decodes are undisturbed, and the long prompt waits for the whole batch to finish.
- Disaggregation (DistServe, ``disaggregate``): the long prompt runs on a prefill worker, the
  decodes on a decode worker, each its own process; only the KV moves. The cores are shared
  out between the workers (one thread each on two cores).

Per mode: p50/p99 time between tokens (TBT) of the steady decodes, the longest gap, TTFT
of the long prompts, output throughput. Plots: the TBT distribution (CDF) per mode, and a
timeline of step durations showing the stalls and their absence.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from travelator.bench.compare import LABELS, MODE_STYLE, jsonable, model_summary, parse_modes, plot_title, pyplot
from travelator.bench.metrics import format_table
from travelator.bench.runner import RunResult, run_engine, run_served, warm_up
from travelator.bench.workloads import decodes_and_long_prompts
from travelator.disagg.frontend import DisaggConfig, DisaggregatedFrontEnd
from travelator.disagg.worker import IDLE_REPORT_S
from travelator.engine_args import engine_config

DEFAULT_MODES = ("static", "dynamic", "orca", "iteration")
DISAGGREGATED = "disaggregated"  # the fifth mode: not a batching mode of one engine


@dataclass(frozen=True, slots=True)
class InterferenceSetup:
    """The workload and its arrival times (seconds from the start)."""

    num_decodes: int = 8
    decode_prompt_len: int = 32
    decode_output_len: int = 384
    num_long: int = 6
    long_prompt_len: int = 1536
    long_output_len: int = 8
    first_long_at_s: float = 0.5
    long_every_s: float = 0.5

    def __post_init__(self) -> None:
        if self.num_decodes < 1 or self.num_long < 1:
            raise ValueError("the interference experiment needs at least one steady decode and one long prompt")
        if self.decode_output_len < 2:
            raise ValueError("a steady decode needs at least 2 output tokens (a time between tokens)")
        if min(self.decode_prompt_len, self.long_prompt_len, self.long_output_len) < 1:
            raise ValueError("prompt and output lengths must be positive")
        if self.first_long_at_s < 0 or self.long_every_s < 0:
            raise ValueError("arrival times must be non-negative")

    def arrivals(self) -> list[float]:
        return [0.0] * self.num_decodes + [self.first_long_at_s + k * self.long_every_s
                                           for k in range(self.num_long)]


TABLE_COLUMNS = [
    ("mode", "mode", ""),
    ("rep", "rep", "{:d}"),
    ("TBT p50 (ms)", "tbt_p50_ms", "{:.1f}"),
    ("TBT p99 (ms)", "tbt_p99_ms", "{:.1f}"),
    ("longest gap (ms)", "tbt_max_ms", "{:.0f}"),
    ("long-prompt TTFT median (ms)", "long_ttft_median_ms", "{:.0f}"),
    ("long-prompt TTFT max (ms)", "long_ttft_max_ms", "{:.0f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("steps", "num_steps", "{:d}"),
    ("max tokens/step", "max_step_tokens", "{:d}"),
    ("load avg", "load_avg_end", "{:.1f}"),
    ("KV moved (MB)", "kv_transfer_mb", "{:.1f}"),
    ("KV send (ms)", "kv_transfer_ms", "{:.0f}"),
]


def interference_metrics(run: RunResult, num_decodes: int) -> dict:
    """TBT of the steady decodes (the first ``num_decodes`` requests), TTFT of the rest."""
    decodes, longs = run.results[:num_decodes], run.results[num_decodes:]
    failed = sum(not r.success for r in run.results)
    gaps_ms = np.array([g for r in decodes for g in r.itls]) * 1000
    ttfts_ms = np.array([r.ttft for r in longs if r.ttft is not None]) * 1000
    out_tokens = sum(r.output_len for r in run.results)
    steps = run.steps
    return {
        "failed": failed,
        "tbt_p50_ms": float(np.percentile(gaps_ms, 50)) if gaps_ms.size else None,
        "tbt_p99_ms": float(np.percentile(gaps_ms, 99)) if gaps_ms.size else None,
        "tbt_max_ms": float(gaps_ms.max()) if gaps_ms.size else None,
        "long_ttft_median_ms": float(np.median(ttfts_ms)) if ttfts_ms.size else None,
        "long_ttft_max_ms": float(ttfts_ms.max()) if ttfts_ms.size else None,
        "output_throughput": out_tokens / run.duration_s,
        "duration_s": run.duration_s,
        "num_steps": len(steps),
        "max_step_tokens": max((s.stats.num_tokens for s in steps), default=0),
        "load_avg_end": run.load_avg[1] if run.load_avg else float("nan"),
    }


def ratio_line(summary: dict[str, dict]) -> str | None:
    """Chunked prefill against whole prompts: their p99 time between tokens; and
    disaggregation against chunked prefill, when it ran."""
    lines = []
    if "iteration" in summary and "orca" in summary:
        chunked, whole = summary["iteration"]["tbt_p99_ms"], summary["orca"]["tbt_p99_ms"]
        lines.append(f"p99 time between tokens of the running decodes: chunked prefill {chunked:.1f} ms vs "
                     f"whole prompts (Orca) {whole:.1f} ms -> {chunked / whole:.2f}x "
                     f"(whole-prompt stalls make it {whole / chunked:.1f}x longer)")
    if DISAGGREGATED in summary and "iteration" in summary:
        d, c = summary[DISAGGREGATED], summary["iteration"]
        lines.append(f"disaggregated vs chunked prefill: p99 TBT {d['tbt_p99_ms']:.1f} vs {c['tbt_p99_ms']:.1f} ms "
                     f"({d['tbt_p99_ms'] / c['tbt_p99_ms']:.2f}x), long-prompt TTFT median "
                     f"{d['long_ttft_median_ms']:.0f} vs {c['long_ttft_median_ms']:.0f} ms, output "
                     f"{d['output_throughput']:.1f} vs {c['output_throughput']:.1f} tok/s "
                     f"({d['output_throughput'] / c['output_throughput']:.2f}x)")
    return "\n".join(lines) or None


def _transfer_totals(engine) -> tuple[int, float]:
    """Bytes and seconds of KV the prefill workers have sent so far. Called at rest: their
    send threads finish after the step that handed off, so wait for a report from after them."""
    time.sleep(2 * IDLE_REPORT_S)
    sent = [s for w, s in engine.stats.items() if w.role == "prefill"]
    return sum(s.transfer_bytes for s in sent), sum(s.transfer_seconds for s in sent)


def run_interference(model: str, engine_kwargs: dict, setup: InterferenceSetup, *,
                     modes: list[str] | tuple[str, ...] = DEFAULT_MODES, repeats: int = 1,
                     output_dir: str | Path = "bench-results", progress: bool = True, log=print,
                     disaggregate: DisaggConfig | None = None) -> dict:
    """``disaggregate``: also run the fifth mode, prefill and decode workers in their own
    processes (chunked prefill in each), sharing this machine's cores."""
    from travelator import LLM

    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    modes = parse_modes(list(modes))
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engines = {}
    for mode in modes:
        engines[mode] = LLM(model, **dict(engine_kwargs, batching=mode)).engine
        # Warm the long prompt's shapes too: a first-time kernel set-up is not a stall.
        warm_up(engines[mode])
        warm_up(engines[mode], num_requests=1, prompt_len=setup.long_prompt_len, output_len=2)
    eng0 = engines[modes[-1]]
    if disaggregate is not None:
        served = DisaggregatedFrontEnd(engine_config(model, **dict(engine_kwargs, batching="iteration")), disaggregate)
        engines[DISAGGREGATED] = served
        warm = decodes_and_long_prompts(vocab_size=eng0.arch.vocab_size, num_decodes=2, decode_prompt_len=16,
                                        decode_output_len=4, num_long=1, long_prompt_len=setup.long_prompt_len,
                                        long_output_len=2, seed=12345)
        run_served(served, warm, progress=False)
        modes = modes + [DISAGGREGATED]
    vocab = eng0.arch.vocab_size
    arrivals = setup.arrivals()
    rows: list[dict] = []
    traces: dict[str, dict] = {}
    for rep in range(repeats):
        # Fresh prompts per run (seeded by the run): no prefix-cache hits on an earlier run's blocks.
        work = decodes_and_long_prompts(
            vocab_size=vocab, num_decodes=setup.num_decodes, decode_prompt_len=setup.decode_prompt_len,
            decode_output_len=setup.decode_output_len, num_long=setup.num_long,
            long_prompt_len=setup.long_prompt_len, long_output_len=setup.long_output_len, seed=rep)
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            if mode == DISAGGREGATED:
                before = _transfer_totals(engines[mode])
                run = run_served(engines[mode], work, arrivals, progress=progress, desc=f"{mode} rep {rep}")
                moved, seconds = (a - b for a, b in zip(_transfer_totals(engines[mode]), before))
            else:
                run = run_engine(engines[mode], work, arrivals, progress=progress, desc=f"{mode} rep {rep}")
            row = {"mode": mode, "rep": rep, **interference_metrics(run, setup.num_decodes)}
            if mode == DISAGGREGATED:  # the KV the prefill workers sent, and their time sending it
                row.update(kv_transfer_mb=moved / 1e6, kv_transfer_ms=seconds * 1000)
                log(f"  {mode} rep {rep}: {moved / 1e6:.1f} MB of KV moved in {seconds * 1000:.0f} ms "
                    f"of sending (by the prefill workers' send threads)")
            rows.append(row)
            if rep == 0:
                traces[mode] = {
                    "tbt_ms": [round(g * 1000, 3) for r in run.results[:setup.num_decodes] for g in r.itls],
                    "steps": run.steps_as_lists(),
                }
            log(f"  {mode:9s} rep {rep}: TBT p99 {row['tbt_p99_ms']:.1f} ms, longest gap "
                f"{row['tbt_max_ms']:.0f} ms, long-prompt TTFT median {row['long_ttft_median_ms']:.0f} ms")
    rows.sort(key=lambda r: (modes.index(r["mode"]), r["rep"]))
    summary = {mode: _medians([r for r in rows if r["mode"] == mode]) for mode in modes}
    model_info = model_summary(model, eng0)
    budget = eng0.config.scheduler.max_num_batched_tokens
    if DISAGGREGATED in engines:
        engines[DISAGGREGATED].stop()
        model_info["disaggregated"] = f"{disaggregate.num_prefill} prefill + {disaggregate.num_decode} decode workers"
    del engines, eng0
    gc.collect()
    line = ratio_line(summary)
    report = {
        "model": model_info, "modes": modes, "setup": asdict(setup), "arrivals_s": arrivals,
        "engine": {k: v for k, v in engine_kwargs.items() if k != "batching"},
        "results": rows, "summary": summary, "ratio_line": line, "traces": traces, "files": {},
    }
    title = f"{plot_title(model_info)}, token budget {budget}"
    report["files"]["tbt_cdf_png"] = str(plot_tbt_cdf(traces, modes, out_dir / "tbt_cdf.png", title))
    report["files"]["timeline_png"] = str(plot_step_timeline(traces, modes, arrivals[setup.num_decodes:],
                                                             out_dir / "step_timeline.png", title))
    path = out_dir / "interference.json"
    report["files"]["json"] = str(path)
    path.write_text(json.dumps(jsonable(report), indent=1))
    return report


def _medians(rows: list[dict]) -> dict:
    """Per measure, the median over the runs (counts stay whole numbers)."""
    out = {}
    for k, v in rows[0].items():
        vals = [r[k] for r in rows if r[k] is not None]
        if k == "rep" or not vals or not isinstance(v, (int, float)):
            continue
        med = float(np.median(vals))
        out[k] = int(round(med)) if all(isinstance(x, int) for x in vals) else med
    return out


def table(rows: list[dict], medians: bool = False) -> str:
    """The runs, one row each; ``medians``: one row per mode (no run number)."""
    return format_table(rows, [c for c in TABLE_COLUMNS if not (medians and c[1] == "rep")])


# ---- plots ----------------------------------------------------------------------------
def plot_tbt_cdf(traces: dict[str, dict], modes: list[str], path: Path, title: str = "") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for mode in modes:
        gaps = np.sort(traces[mode]["tbt_ms"])
        if gaps.size:
            ax.step(gaps, np.arange(1, gaps.size + 1) / gaps.size, where="post",
                    color=MODE_STYLE[mode]["color"], label=LABELS[mode])
    ax.set_xscale("log")
    ax.axhline(0.99, color="gray", ls=":", lw=1, label="p99")
    ax.set_xlabel("time between tokens of a steady decode (ms, log scale)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title(title or "time between tokens", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_step_timeline(traces: dict[str, dict], modes: list[str], long_arrivals: list[float],
                       path: Path, title: str = "") -> Path:
    """Each step's duration at the time it ended; steps that computed prompt tokens marked."""
    plt = pyplot()
    fig, axes = plt.subplots(len(modes), 1, figsize=(8, 1.2 + 1.9 * len(modes)), dpi=110,
                             sharex=True, sharey=True)
    for ax, mode in zip(np.atleast_1d(axes), modes):
        st = traces[mode]["steps"]
        t = np.array(st.get("t", []))
        dur = np.array(st.get("duration_s", [])) * 1000
        prefill = np.array(st.get("num_prefill_tokens", [])) > 0
        color = MODE_STYLE[mode]["color"]
        if t.size:
            ax.vlines(t, 0, dur, color=color, lw=0.6, alpha=0.6)
            ax.scatter(t[prefill], dur[prefill], s=9, color="black", zorder=3,
                       label="step with prompt tokens")
        for k, a in enumerate(long_arrivals):
            ax.axvline(a, color="gray", ls=":", lw=0.8, label="a long prompt arrives" if k == 0 else None)
        ax.set_title(f"{LABELS[mode]}: longest step {dur.max() if dur.size else 0:.0f} ms", fontsize=9)
        ax.set_ylabel("step (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel("time since start (s)")
    fig.suptitle("step durations" + (f" - {title}" if title else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
