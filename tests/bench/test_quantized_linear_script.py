"""benchmarks/quantized_linear.py runs its table end to end at a tiny shape: the script
prepares its weights through the engine's own ops, whose signature it must keep up with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_prints_a_row_for_every_row_count(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its bench_timing import
    monkeypatch.setattr(sys, "argv", ["quantized_linear.py", "--out-features", "128", "--in-features", "256",
                                      "--rows", "1", "8", "--copies", "1", "--repeats", "1", "--no-torch-kernels"])
    spec = importlib.util.spec_from_file_location("quantized_linear_script", REPO / "benchmarks" / "quantized_linear.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rows"])
    rows = [line.split() for line in lines[header + 1:]]
    assert [r[0] for r in rows] == ["1", "8"]
    for r in rows:  # bf16, int8, int4 times (and W8A8 where it is on), then ratios
        times = [float(v) for v in r[1:] if not v.endswith("x")]
        assert len(times) >= 3 and all(t > 0 for t in times)
