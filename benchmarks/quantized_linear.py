"""One linear layer, bf16 against int8 and int4 weights, at the row counts of real steps.

bf16, int8 and int4 run the engine's own path (``NativeOps.linear``). bf16: the streaming
kernel ``small_m_linear`` up to 4 rows, oneDNN's pre-packed GEMM above (AMX /
AVX-512 bf16, or float32 on widened weights where there is no bf16 GEMM). int8 and int4: the
engine's integer kernel (``csrc/quant_linear.cpp``) up to ``NativeOps.quant_kernel_rows`` rows
(printed in the header; ``--quant-kernel-rows`` overrides it), above that, where there is a bf16
GEMM, the GEMM on a bf16 copy of the weight kept since ``prepare`` (as the engine keeps one at
its default ``quantized_gemm_copies="auto"``: then the kernel takes up to 8 or 16 rows), else the
weight dequantized at every call and the GEMM. "W8A8": int8 weights through the W8A8 kernel
(``csrc/quant_w8a8.cpp``, x quantized per row to int8) from ``NativeOps.w8a8_rows`` rows, where
it is on (CPUs without a bf16 GEMM); "int8" is then the same route with it off, the weight-only
kernel and the dequantizing path. "torch int8" and "torch int4" are
torch's own CPU kernels on the same codes (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``), for comparison. The weight is larger than the L3 cache by default (the 250M model's gate/up
projection, 5632 x 1024, repeated over 8 copies), so each call streams it from memory, as in a
decode step. Medians of repeats; the CPU and the load average are printed first.

    python benchmarks/quantized_linear.py
    python benchmarks/quantized_linear.py --out-features 2048 --in-features 512 --rows 1 16 64 256
    python benchmarks/quantized_linear.py --rows 16 64 256 1024 2048 --copies 2 --repeats 3 --no-torch-kernels
"""

from __future__ import annotations

import argparse
import os

import torch

from bench_timing import median_seconds

from travelator.model.device import cpu_model_name
from travelator.model.ops import NativeOps, TorchOps
from travelator.model.quant import Int4Weight, Int8Weight, quantize


def torch_int8(w: Int8Weight):
    """torch's int8 kernel on the same codes and scales."""
    codes, scales = w.codes(), w.scales[: w.out_features].bfloat16()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales)


def torch_int4(w: Int4Weight):
    """torch's int4 kernel on the same codes, scales and zeros (its layout, 2 inner k-tiles)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes().to(torch.int32), 2)
    scale, zero = w.group_params()
    scales_zeros = torch.stack([scale.T, zero.T], dim=-1).bfloat16().contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, w.group_size, scales_zeros)


def with_w8a8(ops, rows: int):
    """ops.linear with int8 layers taking W8A8 from ``rows`` rows (0: never)."""
    def linear(x, w):
        if rows or getattr(ops, "w8a8_rows", 0):
            ops.w8a8_rows = rows
        return ops.linear(x, w)
    return linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-features", type=int, default=5632)
    ap.add_argument("--in-features", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--copies", type=int, default=8, help="weights cycled through, so none stays in cache")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-torch-kernels", action="store_true",
                    help="leave out torch's int8/int4 kernels (on AVX2 CPUs they take minutes)")
    ap.add_argument("--quant-kernel-rows", type=int,
                    help="rows up to which int8/int4 take the integer kernel (0: always dequantize)")
    args = ap.parse_args()
    print(f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}; weight [{args.out_features}, {args.in_features}] x "
          f"{args.copies} copies", flush=True)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(args.out_features, args.in_features, generator=g) * 0.02).bfloat16()
               for _ in range(args.copies)]
    try:
        ops: TorchOps = NativeOps()
    except Exception:  # noqa: BLE001 - no compiler here: torch's own bf16 path
        ops = TorchOps()
    int8 = [quantize(w, "int8") for w in weights]
    int4 = [quantize(w, "int4", args.group_size) for w in weights]
    # As the engine prepares a model: every weight, for bf16 activations.
    ops.prepare(weights + int8 + int4, torch.bfloat16)
    if args.quant_kernel_rows is not None:
        ops.quant_kernel_rows = args.quant_kernel_rows
    w8a8_rows = getattr(ops, "w8a8_rows", 0)
    kernel_rows = getattr(ops, "quant_kernel_rows", 0)  # torch's ops: always dequantized
    kernel = f"up to {kernel_rows} rows" if kernel_rows else "off"
    w8a8 = f"from {w8a8_rows} rows" if w8a8_rows else "off"
    print(f"int8/int4: the integer kernel {kernel}; W8A8 {w8a8}", flush=True)
    kinds = {
        "bf16": (weights, ops.linear),
        "int8": (int8, with_w8a8(ops, 0)),
        "int4": (int4, ops.linear),
    }
    if w8a8_rows:
        kinds["W8A8"] = (int8, with_w8a8(ops, w8a8_rows))
    if not args.no_torch_kernels:
        kinds["torch int8"] = ([torch_int8(w) for w in int8], lambda x, f: f(x))
        kinds["torch int4"] = ([torch_int4(w) for w in int4], lambda x, f: f(x))
    ratios = [("int8", "bf16"), ("int4", "bf16")] + ([("W8A8", "bf16"), ("W8A8", "int8")] if w8a8_rows else [])
    print(f"{'rows':>5} " + " ".join(f"{k + ' (ms)':>16}" for k in kinds)
          + "".join(f"{a + ' vs ' + b:>15}" for a, b in ratios))
    for m in args.rows:
        x = torch.randn(m, args.in_features, generator=g).bfloat16()
        ms = {}
        for kind, (ws, linear) in kinds.items():
            def run_all(ws=ws, linear=linear):
                for w in ws:
                    linear(x, w)
            ms[kind] = median_seconds(run_all, args.repeats) / len(ws) * 1e3
        print(f"{m:>5} " + " ".join(f"{ms[k]:>16.3f}" for k in kinds)
              + "".join(f"{ms[b] / ms[a]:>14.2f}x" for a, b in ratios), flush=True)


if __name__ == "__main__":
    main()
