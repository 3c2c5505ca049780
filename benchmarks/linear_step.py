"""The linear layers of one decode step: oneDNN's packed bf16 GEMM against blocked_linear.

Each layer's four GEMMs (QKV, output, gate/up, down) of a random-init 50M or 250M Llama (8 or
16 distinct layers, so their weights stream from memory as in a real step) and then the LM
head, at several row counts; medians of 9. For comparison, the time of a float32 sum over the
same bytes and the GEMMs' arithmetic at ``--peak-gflops``. blocked_linear is built on CPUs
with AVX512-BF16; with AMX it runs on the tiles (for inputs a multiple of 32, as here).

    python benchmarks/linear_step.py --preset 50m
"""

from __future__ import annotations

import argparse

import torch

from bench_timing import median_seconds

from travelator import kernels
from travelator.model.native_linear import blocked_linear_weight

PRESETS = {"50m": (512, 1408, 256, 8), "250m": (1024, 2816, 512, 16)}  # hidden, intermediate, KV width, layers


def median_ms(fn) -> float:
    return median_seconds(fn, 9) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="50m")
    ap.add_argument("--rows", default="1,2,8,20,40,64")
    ap.add_argument("--peak-gflops", type=float, default=980.0,
                    help="the CPU's bf16 GEMM rate, for the arithmetic's time (default: the rate "
                         "measured on the AVX512-BF16 machine of docs/benchmarks.md)")
    args = ap.parse_args()
    kernels.load()
    if not hasattr(torch.ops.travelator, "blocked_linear"):
        raise SystemExit("blocked_linear is not built on this CPU (it needs AVX512-BF16)")
    hidden, inter, kv_width, layers = PRESETS[args.preset]
    shapes = [(hidden, hidden + 2 * kv_width), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for k, n in shapes] for _ in range(layers)]
    lm_head = torch.randn(32000, hidden).bfloat16()
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in weights]
    blocked = [[blocked_linear_weight(w) for w in ws] for ws in weights]
    lm_onednn, lm_blocked = torch.ops.mkldnn._reorder_linear_weight(lm_head, None), blocked_linear_weight(lm_head)
    params = layers * sum(k * n for k, n in shapes) + hidden * 32000
    ones = torch.ones(params * 2 // 4)
    read_ms = median_ms(lambda: ones.sum())
    linear = torch.ops.mkldnn._linear_pointwise
    blocked_linear = torch.ops.travelator.blocked_linear
    print(f"{args.preset}: {params * 2 / 1e6:.0f} MB of weights, a float32 sum over them {read_ms:.2f} ms "
          f"({params * 2 / read_ms / 1e6:.0f} GB/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k).bfloat16() for k in (hidden, inter)}
        a = median_ms(lambda: ([linear(x[k], w, None, "none", [], "") for ws in onednn for (k, _), w in zip(shapes, ws)],
                               linear(x[hidden], lm_onednn, None, "none", [], "")))
        b = median_ms(lambda: ([blocked_linear(x[k], w, None) for ws in blocked for (k, _), w in zip(shapes, ws)],
                               blocked_linear(x[hidden], lm_blocked, None)))
        print(f"  {rows:4d} rows: oneDNN {a:.2f} ms, blocked_linear {b:.2f} ms ({a / b:.2f}x); "
              f"arithmetic at {args.peak_gflops:g} GFLOP/s {2 * rows * params / (args.peak_gflops * 1e6):.2f} ms")


if __name__ == "__main__":
    main()
