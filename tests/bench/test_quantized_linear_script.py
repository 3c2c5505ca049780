"""benchmarks/quantized_linear.py runs its table end to end at a tiny shape: the script
prepares its weights through the engine's own ops, whose signature it must keep up with, and
its row counts reach past the integer kernel's (the GEMM on a kept copy, where there is one)."""

from __future__ import annotations

import sys
from pathlib import Path

from paths import load_script

REPO = Path(__file__).resolve().parents[2]
ROWS = ["1", "8", "32"]


def test_the_script_prints_a_row_for_every_row_count(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its bench_timing import
    monkeypatch.setattr(sys, "argv", ["quantized_linear.py", "--out-features", "128", "--in-features", "256",
                                      "--rows", *ROWS, "--copies", "1", "--repeats", "1",
                                      "--no-torch-kernels"])
    load_script("quantized_linear_script", REPO / "benchmarks" / "quantized_linear.py").main()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rows"])
    words = lines[header].split()
    kinds = [word for word, unit in zip(words, words[1:]) if unit == "(ms)"]
    assert kinds[:3] == ["bf16", "int8", "int4"] and set(kinds[3:]) <= {"W8A8"}
    ratios = 2 + 2 * (len(kinds) - 3)  # int8 and int4 against bf16; W8A8 against bf16 and int8
    rows = [line.split() for line in lines[header + 1:]]
    assert [r[0] for r in rows] == ROWS
    for r in rows:
        assert len(r) == 1 + len(kinds) + ratios
        assert all(float(t) >= 0 for t in r[1:1 + len(kinds)]) and all(v.endswith("x") for v in r[1 + len(kinds):])
