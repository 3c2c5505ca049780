"""``bench throughput --profile``: where the time goes.

What it prints today:

- the share of wall time spent inside ``engine.step()`` against the benchmark loop;
- per-phase engine timings, ``engine.phase_times`` (phase name -> seconds, accumulated over
  the run: schedule and update+detokenize from the engine, prepare, forward and sample from
  the model executor);
- the top operators by self CPU time from ``torch.profiler``, and a Chrome trace when a
  path is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from travelator.bench.runner import RunResult
    from travelator.engine.engine import LLMEngine


@contextlib.contextmanager
def torch_profiler(trace_path: str | None = None) -> Iterator[object]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield prof
    if trace_path:
        prof.export_chrome_trace(trace_path)


def profile_report(engine: LLMEngine, run: RunResult, prof=None, row_limit: int = 15) -> str:
    lines = ["", "=== profile ==="]
    summary = run.step_summary()
    step_time = summary.get("step_time_s", 0.0)
    wall = run.duration_s or float("nan")
    lines.append(f"wall {wall:.2f} s, inside engine.step() {step_time:.2f} s "
                 f"({step_time / wall:.0%}), {summary.get('num_steps', 0)} steps, "
                 f"mean {summary.get('mean_step_ms', 0):.1f} ms/step")
    phases = engine.phase_times
    total = sum(phases.values()) or float("nan")
    lines.append("engine phases:")
    for name, secs in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<14} {secs:8.3f} s  {secs / total:6.1%}")
    if prof is not None:
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit))
    return "\n".join(lines)
