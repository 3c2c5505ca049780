"""The Orca experiment: request-level batching (static, dynamic) against iteration-level
scheduling (Orca's whole prompts, chunked prefill), same model, same kernels, same
workload and arrivals, over a sweep of request rates.

For each rate every engine serves the same requests arriving on the same Poisson
schedule (the gaps of one seed, scaled by 1/rate), driven offline (see runner.py).
The runs are interleaved (rate 1: modes in order, rate 2: reversed, ...) so that slow
drift in the machine's load hits all alike.

Outputs: a table, ``compare.json``, ``latency_vs_throughput.png`` (median normalised
latency in s/token against throughput in requests/s, as Orca's figures plot it),
``batch_occupancy.png`` (busy seats per step against ``max_num_seqs``), ``walkway.html``
(the occupancy rate's runs replayed one above the other in the live view's page: who sat where at
each step; it opens from disk), and one line per baseline with the iteration-level throughput
ratio at the same latency target.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from travelator.bench.arrivals import arrival_times
from travelator.bench.metrics import compute_metrics, format_markdown_table, format_table
from travelator.bench.runner import RunResult, busy_seconds, run_engine, warm_up
from travelator.bench.workloads import Workload
from travelator.dashboard.page import render_page
from travelator.dashboard.walkway import WalkwayRecorder

BATCHING_MODES = ("static", "dynamic", "orca", "iteration")  # the history's order
DEFAULT_MODES = ("static", "iteration")
MODE_ALIASES = {"chunked": "iteration"}  # Sarathi-Serve's name for what the engine calls iteration
LABELS = {"static": "static batching", "dynamic": "dynamic batching",
          "orca": "Orca (iteration-level, whole prompts)",
          "iteration": "iteration-level, chunked prefill",
          "disaggregated": "disaggregated prefill/decode (DistServe)"}


def parse_modes(names: list[str]) -> list[str]:
    """Batching modes in the history's order, aliases resolved, each once."""
    modes = {MODE_ALIASES.get(n, n) for n in names}
    unknown = modes - set(BATCHING_MODES)
    if unknown:
        raise ValueError(f"unknown batching mode(s) {sorted(unknown)}; choose from "
                         f"{', '.join(BATCHING_MODES)} (chunked = iteration)")
    if len(modes) < 2:
        raise ValueError("compare needs at least two batching modes")
    return [m for m in BATCHING_MODES if m in modes]


def subject_mode(modes: list[str]) -> str:
    """The mode every other is measured against: the newest in the history."""
    return modes[-1]

TABLE_COLUMNS = [
    ("rate (req/s)", "rate", "{:g}"),
    ("scheduler", "scheduler", ""),
    ("req/s", "request_throughput", "{:.3f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("median norm. latency (s/tok)", "median_norm_latency_s_per_token", "{:.4f}"),
    ("median TTFT (ms)", "median_ttft_ms", "{:.0f}"),
    ("p99 E2E (ms)", "p99_e2el_ms", "{:.0f}"),
    ("mean busy seats", "mean_batch_requests", "{:.1f}"),
    ("occupancy", "time_weighted_occupancy", "{:.0%}"),
    ("preempted", "preemptions", "{:d}"),
    ("load avg", "load_avg_end", "{:.1f}"),
]


@dataclass(slots=True)
class ThroughputAtTarget:
    value: float | None  # req/s at the target; None when even the lightest load misses it
    lower_bound: bool  # the curve never reached the target: the true value is higher


def throughput_at_latency(points: list[tuple[float, float]], target: float) -> ThroughputAtTarget:
    """The highest throughput a curve sustains with latency <= ``target``.

    ``points`` are (throughput, latency) in sweep order (increasing offered load).
    Between a point under the target and the next one over it, the throughput is
    interpolated linearly in latency. If the last point is still under the target the
    result is a lower bound.
    """
    best: float | None = None
    for i, (thr, lat) in enumerate(points):
        if lat <= target:
            best = thr if best is None else max(best, thr)
            if i + 1 < len(points):
                thr2, lat2 = points[i + 1]
                if lat2 > target:
                    cross = thr + (thr2 - thr) * (target - lat) / (lat2 - lat)
                    best = max(best, cross)
    lower = bool(points) and points[-1][1] <= target
    return ThroughputAtTarget(best, lower)


def default_latency_target(rows: list[dict]) -> float:
    """Twice the lowest median normalised latency measured: 'twice the latency of a
    lightly loaded engine'."""
    lats = [r["median_norm_latency_s_per_token"] for r in rows
            if r.get("median_norm_latency_s_per_token") is not None]
    if not lats:
        raise ValueError("no latency was measured")
    return 2.0 * min(lats)


def ratio_line(rows: list[dict], target: float, subject: str = "iteration",
               baseline: str = "static") -> tuple[str, dict]:
    """The throughput ``subject`` sustains at the latency target against ``baseline``'s."""
    res = {}
    for sched in (subject, baseline):
        pts = [(r["request_throughput"], r["median_norm_latency_s_per_token"])
               for r in rows if r["scheduler"] == sched and r["median_norm_latency_s_per_token"] is not None]
        res[sched] = throughput_at_latency(pts, target)
    it, st = res[subject], res[baseline]

    def fmt(x: ThroughputAtTarget) -> str:
        if x.value is None:
            return "n/a (above the target at every rate)"
        return f"{'>=' if x.lower_bound else ''}{x.value:.3f} req/s"

    info = {"latency_target_s_per_token": target, "subject": subject, "baseline": baseline,
            f"{subject}_req_per_s": it.value, f"{subject}_lower_bound": it.lower_bound,
            f"{baseline}_req_per_s": st.value, f"{baseline}_lower_bound": st.lower_bound, "ratio": None}
    if it.value is not None and st.value:
        ratio = it.value / st.value
        info["ratio"] = ratio
        qual = ""
        if it.lower_bound and not st.lower_bound:
            qual = "at least "
        elif st.lower_bound and not it.lower_bound:
            qual = "at most "
        elif st.lower_bound and it.lower_bound:
            qual = "about (both lower bounds) "
        head = f"{qual}{ratio:.2f}x"
    elif it.value is not None:
        head = f"unbounded ({baseline} never meets the target)"
    else:
        head = "n/a"
    line = (f"Throughput ratio at median normalised latency <= {target:.4f} s/token: {LABELS[subject]} "
            f"{fmt(it)} vs {LABELS[baseline]} {fmt(st)} -> {head}")
    return line, info


def run_compare(
    model: str,
    engine_kwargs: dict,
    workload: Workload,
    rates: list[float],
    *,
    modes: list[str] | tuple[str, ...] = DEFAULT_MODES,
    burstiness: float = 1.0,
    arrival_seed: int = 0,
    latency_target: float | None = None,
    occupancy_rate: float | None = None,
    output_dir: str | Path = "bench-results",
    progress: bool = True,
    log=print,
) -> dict:
    from travelator import LLM

    if not rates:
        raise ValueError("give at least one request rate")
    modes = parse_modes(list(modes))
    subject = subject_mode(modes)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = sorted(rates)
    occ_rate = occupancy_rate if occupancy_rate is not None else rates[-1]
    if occ_rate not in rates:
        raise ValueError(f"the occupancy rate {occ_rate:g} is not one of the swept rates")
    engines = {}
    for sched in modes:
        kw = dict(engine_kwargs, batching=sched)
        engines[sched] = LLM(model, **kw).engine
        warm_up(engines[sched])
    eng0 = engines[subject]
    max_num_seqs = eng0.config.scheduler.max_num_seqs
    rows: list[dict] = []
    traces: dict[str, dict] = {}
    walkways: list[dict] = []  # the occupancy rate's runs, step by step, for walkway.html
    for k, rate in enumerate(rates):
        arrivals = arrival_times(len(workload), rate, burstiness=burstiness, seed=arrival_seed)
        # A fresh first token per rate: no prefix-cache hits on the previous rate's blocks.
        work = workload.salted(k)
        # Alternate the order, so that no mode always runs first, on a colder cache.
        for sched in (modes if k % 2 == 0 else modes[::-1]):
            on_step = None
            if rate == occ_rate:
                on_step, panel = walkway_recording(engines[sched], sched)
                walkways.append(panel)
            run: RunResult = run_engine(engines[sched], work, arrivals, progress=progress,
                                        desc=f"{sched} @ {rate:g} req/s", on_step=on_step)
            m = compute_metrics(run.results, run.duration_s)
            row = {"rate": rate, "scheduler": sched, **m, **run.step_summary()}
            rows.append(row)
            if rate == occ_rate:
                traces[sched] = run.steps_as_lists()
            log(f"  rate {rate:g} req/s, {sched:9s}: {m['request_throughput']:.3f} req/s, "
                f"median normalised latency {m['median_norm_latency_s_per_token']:.4f} s/token, "
                f"mean busy seats {row.get('mean_batch_requests', 0):.1f}/{max_num_seqs}")
    rows.sort(key=lambda r: (r["rate"], modes.index(r["scheduler"])))
    model_info = model_summary(model, eng0)
    del engines, eng0
    gc.collect()
    target = latency_target if latency_target is not None else default_latency_target(rows)
    ratios = [ratio_line(rows, target, subject, base) for base in modes if base != subject]
    report = {
        "model": model_info,
        "modes": modes,
        "engine": {k: v for k, v in engine_kwargs.items() if k != "batching"},
        "workload": workload.summary(),
        "arrivals": {"process": "poisson" if burstiness == 1 else "gamma",
                     "burstiness": burstiness, "seed": arrival_seed},
        "rates": rates,
        "results": rows,
        "occupancy_trace": {"rate": occ_rate, "max_num_seqs": max_num_seqs, "steps": traces},
        "ratios": [info for _, info in ratios],
        "ratio_lines": [line for line, _ in ratios],
        "files": {},
    }
    report["files"]["latency_png"] = str(plot_latency_vs_throughput(
        rows, modes, target, out_dir / "latency_vs_throughput.png", title=plot_title(model_info)))
    report["files"]["occupancy_png"] = str(plot_occupancy(
        traces, modes, max_num_seqs, occ_rate, out_dir / "batch_occupancy.png", title=plot_title(model_info)))
    walkways.sort(key=lambda w: modes.index(w["name"]))
    replay = {"title": f"{plot_title(model_info)} · {occ_rate:g} req/s", "panels": walkways,
              "speed": 1}
    html_path = out_dir / "walkway.html"
    html_path.write_text(render_page(replay))
    report["files"]["walkway_html"] = str(html_path)
    json_path = out_dir / "compare.json"
    report["files"]["json"] = str(json_path)
    json_path.write_text(json.dumps(jsonable(report), indent=1))
    return report


def walkway_recording(engine, name: str) -> tuple[Callable[[list], None], dict]:
    """A step hook for ``run_engine`` that records the run's walkway (seats per step, as the
    live view's stream), on a clock that starts now, and the replay panel it fills."""
    start = time.perf_counter()
    recorder = WalkwayRecorder(engine, clock=lambda: round(time.perf_counter() - start, 4))
    panel = {"name": name, "info": recorder.info(), "records": [], "t0": 0.0}

    def on_step(outputs: list) -> None:
        panel["records"].append(recorder.record(outputs))

    return on_step, panel


def model_summary(model: str, engine) -> dict:
    """What a report says of the model an engine runs."""
    return {"model": model, "name": engine.model_name, "num_parameters": engine.arch.num_parameters,
            "dtype": str(engine.dtype).replace("torch.", ""), "device": str(engine.device)}


def plot_title(info: dict) -> str:
    n = info["num_parameters"]
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else (f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K")
    return f"{info['name']} ({size} params, {info['dtype']}, {info['device']})"


def jsonable(x):
    """The object with inf and nan floats spelled as strings, which JSON cannot hold."""
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def table(rows: list[dict], markdown: bool = False) -> str:
    fmt = format_markdown_table if markdown else format_table
    return fmt(rows, TABLE_COLUMNS)


# ---- plots ----------------------------------------------------------------------------
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MODE_STYLE = {"static": dict(color="tab:red", marker="s", label=LABELS["static"]),
          "dynamic": dict(color="tab:orange", marker="D", label=LABELS["dynamic"]),
          "orca": dict(color="tab:green", marker="^", label=LABELS["orca"]),
          "iteration": dict(color="tab:blue", marker="o", label=LABELS["iteration"]),
          "disaggregated": dict(color="tab:purple", marker="v", label=LABELS["disaggregated"])}


def plot_latency_vs_throughput(rows: list[dict], modes: list[str], target: float, path: Path,
                               title: str = "") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    lats = []
    for sched in modes:
        pts = [(r["request_throughput"], r["median_norm_latency_s_per_token"], r["rate"])
               for r in rows if r["scheduler"] == sched and r["median_norm_latency_s_per_token"] is not None]
        if not pts:
            continue
        xs, ys, rs = zip(*pts)
        lats += ys
        ax.plot(xs, ys, **MODE_STYLE[sched])
        for x, y, rate in pts:
            ax.annotate(f"{rate:g}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=MODE_STYLE[sched]["color"])
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"latency target {target:.3f} s/token")
    if lats and max(lats) / max(min(lats), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalised latency (s/token)")
    ax.set_title(title or "latency vs throughput", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.99, 0.01, "labels: offered rate (req/s)", ha="right", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_occupancy(traces: dict[str, dict], modes: list[str], max_num_seqs: int, rate: float, path: Path,
                   title: str = "") -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(len(modes), 1, figsize=(8, 1.2 + 1.9 * len(modes)), dpi=110, sharey=True)
    ymax = max([max_num_seqs] + [w for tr in traces.values() for w in tr.get("num_waiting", [])])
    for ax, sched in zip(axes, modes):
        tr = traces.get(sched) or {}
        busy = tr.get("num_requests", [])
        waiting = tr.get("num_waiting", [])
        steps = range(len(busy))
        color = MODE_STYLE[sched]["color"]
        ax.fill_between(steps, busy, step="post", alpha=0.45, color=color, label="busy seats")
        ax.step(steps, busy, where="post", color=color, lw=0.8)
        if waiting:
            ax.plot(steps, waiting, color="gray", lw=0.7, alpha=0.8, label="waiting requests")
        ax.axhline(max_num_seqs, color="black", ls="--", lw=1, label=f"max_num_seqs = {max_num_seqs}")
        if busy:
            dur = tr.get("duration_s", [])
            tot = busy_seconds(tr.get("t", []), dur) or 1.0
            occ = sum(b * d for b, d in zip(busy, dur)) / (tot * max_num_seqs)
            ax.set_title(f"{MODE_STYLE[sched]['label']}: {len(busy)} steps, "
                         f"{occ:.0%} of seat-time busy", fontsize=9)
        ax.set_ylabel("requests")
        ax.set_ylim(0, ymax * 1.35)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    axes[-1].set_xlabel("engine step")
    fig.suptitle(f"batch occupancy per step at {rate:g} req/s" + (f" - {title}" if title else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
