"""The machine's roofline, and workload W's and batch 1's bounds on it.

Measures, with every core: the float32 FMA peak, the bf16 dot peaks (AVX512-BF16's vdpbf16ps,
and AMX's tdpbf16ps on tiles where the CPU has them) and the int8 dot peak
(VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd) of a register-only
loop compiled here for this CPU, the GEMMs torch reaches in each (what a kernel can hope
for), and the memory bandwidth (a float32 sum over a buffer far larger than the caches).
Then, for a model and a weight format, the bounds:

- batch 1: a decode step reads every weight once (the embedding only one row), and does two
  FLOPs per weight; its floor is the larger of the two times;
- workload W (../shared/peers/workload_w.py, 64 requests present at t=0): each decode step s
  serves the requests whose outputs are longer than s, reads the weights once and each
  request's KV so far, and does its FLOPs; prompts (and the step-0 logits) cost FLOPs only,
  placed first in the memory-bound steps' slack. The sum over steps is W's floor: no
  schedule of the same FLOPs and bytes on this machine is faster.

    python benchmarks/roofline.py                        # 50M, bf16 weights
    python benchmarks/roofline.py --preset 250m --format int8
    python benchmarks/roofline.py --measured-w 680       # W's tok/s as a share of the bound

Attention's FLOPs count; norms, rope and sampling do not (a bound, not a model of the time).
The bf16 bound takes the best of the bf16 peaks and torch's bf16 GEMM (a GEMM cannot pass
its unit's peak; the GEMM row shows how near a tuned one gets).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch1_decode import stream_seconds, weight_bytes_per_decode  # noqa: E402
from bench_timing import median_seconds  # noqa: E402

PEERS = Path(__file__).resolve().parent.parent.parent / "shared" / "peers"

# Register-only loops: independent accumulators (more than latency x ports), so the loop runs
# at the units' throughput. Each returns the operations it did.
PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#define CHAINS 12
// Unrolled, so the accumulators live in registers (not memory) across iterations.
#define UNROLL _Pragma("GCC unroll 12")
extern "C" double fma_f32(long iters) {
  double ops = 0; float sink = 0;
#pragma omp parallel reduction(+ : ops, sink)
  {
#if defined(__AVX512F__)
    __m512 acc[CHAINS]; __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < iters; ++i)
      UNROLL for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_fmadd_ps(acc[j], b, c);
    for (int j = 0; j < CHAINS; ++j) sink += _mm512_reduce_add_ps(acc[j]);
    ops += 2.0 * 16 * CHAINS * iters;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[CHAINS]; __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_set1_ps((float)j);
    for (long i = 0; i < iters; ++i)
      UNROLL for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_fmadd_ps(acc[j], b, c);
    float out[8];
    for (int j = 0; j < CHAINS; ++j) { _mm256_storeu_ps(out, acc[j]); sink += out[0]; }
    ops += 2.0 * 8 * CHAINS * iters;
#endif
  }
  return sink == 12345.0f ? -ops : ops;  // sink keeps the loop alive
}
extern "C" double dot_bf16(long iters) {
  double ops = 0; float sink = 0;
#if defined(__AVX512BF16__)
#pragma omp parallel reduction(+ : ops, sink)
  {
    __m512 acc[CHAINS]; __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_setzero_ps();
    for (long i = 0; i < iters; ++i)
      UNROLL for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
    for (int j = 0; j < CHAINS; ++j) sink += _mm512_reduce_add_ps(acc[j]);
    ops += 2.0 * 32 * CHAINS * iters;
  }
#endif
  return sink == 12345.0f ? -ops : ops;
}
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
// AMX: four 16 x 16 float sums, each a product of two of four 16 x 32 bf16 tiles (tdpbf16ps),
// the operands held in tiles; 0 where the CPU has no AMX or Linux does not lend the tiles.
extern "C" double tiles_bf16(long iters) {
  double ops = 0; float sink = 0;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
#pragma omp parallel reduction(+ : ops, sink)
  {
    struct alignas(64) { unsigned char palette = 1, start = 0, reserved[14] = {}; unsigned short colsb[16] = {};
                         unsigned char rows[16] = {}; } cfg;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    alignas(64) float out[256] = {};
    for (int t = 0; t < 4; ++t) out[t] = 1.0f;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, out, 64); _tile_loadd(5, out, 64); _tile_loadd(6, out, 64); _tile_loadd(7, out, 64);
    for (long i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    sink += out[0];
    ops += 2.0 * 4 * 16 * 16 * 32 * iters;
  }
#endif
  return sink == 12345.0f ? -ops : ops;
}
extern "C" double dot_int8(long iters) {
  double ops = 0; long sink = 0;
#pragma omp parallel reduction(+ : ops, sink)
  {
#if defined(__AVX512VNNI__)
    __m512i acc[CHAINS]; __m512i a = _mm512_set1_epi8(1);
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_setzero_si512();
    for (long i = 0; i < iters; ++i)
      UNROLL for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, a);
    for (int j = 0; j < CHAINS; ++j) sink += _mm512_reduce_add_epi32(acc[j]);
    ops += 2.0 * 64 * CHAINS * iters;
#elif defined(__AVX2__)
    // AVX2: u8 x s8 pairs summed to int16 (vpmaddubsw), then to int32 (vpmaddwd by ones).
    __m256i acc[CHAINS]; __m256i a = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_setzero_si256();
    for (long i = 0; i < iters; ++i)
      UNROLL for (int j = 0; j < CHAINS; ++j)
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, a), ones));
    int out[8];
    for (int j = 0; j < CHAINS; ++j) { _mm256_storeu_si256((__m256i*)out, acc[j]); sink += out[0]; }
    ops += 2.0 * 32 * CHAINS * iters;
#endif
  }
  return sink == 12345 ? -ops : ops;
}
extern "C" int has_bf16_dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
extern "C" const char* int8_dot_name() {
#if defined(__AVX512VNNI__)
  return "AVX512-VNNI vpdpbusd";
#elif defined(__AVX2__)
  return "AVX2 vpmaddubsw + vpmaddwd";
#else
  return "none";
#endif
}
"""


@dataclass(frozen=True, slots=True)
class Machine:
    fma_f32: float  # FLOP/s
    dot_bf16: float | None
    tiles_bf16: float | None  # AMX's tdpbf16ps
    dot_int8: float  # int8 OP/s (a multiply and an add each)
    int8_name: str
    gemm_f32: float
    gemm_bf16: float | None
    bandwidth: float  # bytes/s read


def peak_loops() -> ctypes.CDLL:
    """The loops above, compiled for this CPU (-march=native) with OpenMP."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "peak.cpp").write_text(PEAK_SOURCE)
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(tmp / "peak.so"),
                    str(tmp / "peak.cpp")], check=True)
    lib = ctypes.CDLL(str(tmp / "peak.so"))
    for name in ("fma_f32", "dot_bf16", "tiles_bf16", "dot_int8"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_long]
    lib.int8_dot_name.restype = ctypes.c_char_p
    return lib


def ops_per_second(loop, iters: int = 20_000_000) -> float:
    """The best of five runs of a peak loop, OP/s."""
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        ops = loop(iters)
        best = max(best, abs(ops) / (time.perf_counter() - t0))
    return best


def gemm_flops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats=5)


def bandwidth(nbytes: int = 1 << 30) -> float:
    return nbytes / stream_seconds(nbytes, repeats=9)


def measure_machine() -> Machine:
    lib = peak_loops()
    bf16_dot = bool(lib.has_bf16_dot())
    bf16_gemm = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return Machine(
        fma_f32=ops_per_second(lib.fma_f32),
        dot_bf16=ops_per_second(lib.dot_bf16) if bf16_dot else None,
        tiles_bf16=ops_per_second(lib.tiles_bf16, iters=2_000_000) or None,
        dot_int8=ops_per_second(lib.dot_int8),
        int8_name=lib.int8_dot_name().decode(),
        gemm_f32=gemm_flops(torch.float32),
        gemm_bf16=gemm_flops(torch.bfloat16) if bf16_gemm else None,
        bandwidth=bandwidth(),
    )


@dataclass(frozen=True, slots=True)
class ModelCost:
    decode_bytes: int  # weights a one-token step reads
    layer_params: int  # weights every token multiplies (the decoder layers)
    head_params: int  # the LM head's, multiplied for sampled rows only
    kv_bytes_per_token: int  # all layers, K and V
    attn_flops_per_key: int  # per query token and key: QK and PV, all layers and heads


def model_cost(model: str, dtype: str, quantization: str) -> ModelCost:
    """The model's weights as travelator holds them in this format (its quantized bytes,
    scales included), and its per-token costs."""
    from travelator import LLM

    llm = LLM(model, dtype=dtype, quantization=quantization, num_kv_blocks=32, max_model_len=512)
    m, arch = llm.engine.runner.model, llm.engine.arch
    head = arch.vocab_size * arch.hidden_size
    layers = arch.num_parameters - head * (1 if arch.tie_word_embeddings else 2)
    kv_elem = torch.empty(0, dtype=llm.engine.runner.kv_dtype).element_size()
    return ModelCost(
        decode_bytes=weight_bytes_per_decode(m),
        layer_params=layers,
        head_params=head,
        kv_bytes_per_token=2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * kv_elem,
        attn_flops_per_key=4 * arch.num_layers * arch.num_heads * arch.head_dim,
    )


def w_bound_seconds(cost: ModelCost, work: list[tuple[int, int]], compute: float, bw: float) -> float:
    """W's floor: (prompt length, output length) per request, all present at t=0."""
    prefill = sum(2 * cost.layer_params * p + cost.attn_flops_per_key * p * (p + 1) / 2 + 2 * cost.head_params
                  for p, _ in work)
    total, slack = 0.0, 0.0
    for s in range(1, max(o for _, o in work)):  # decode step s: the (s+1)-th output token
        active = [p + s for p, o in work if o > s]
        flops = sum(2 * (cost.layer_params + cost.head_params) + cost.attn_flops_per_key * ctx for ctx in active)
        nbytes = cost.decode_bytes + cost.kv_bytes_per_token * sum(active)
        total += max(flops / compute, nbytes / bw)
        slack += max(0.0, nbytes / bw - flops / compute)
    return total + max(0.0, prefill / compute - slack)


def batch1_bound_seconds(cost: ModelCost, context: int, compute: float, bw: float) -> float:
    flops = 2 * (cost.layer_params + cost.head_params) + cost.attn_flops_per_key * context
    return max(flops / compute, (cost.decode_bytes + cost.kv_bytes_per_token * context) / bw)


def compute_peak(machine: Machine, fmt: str) -> tuple[float, str]:
    """The multiply peak a format's GEMMs can reach here, and its name."""
    if fmt in ("int8", "int4"):
        return machine.dot_int8, f"int8 dot ({machine.int8_name})"
    if fmt == "bfloat16" and machine.gemm_bf16 is not None:
        best = max(machine.dot_bf16 or 0.0, machine.tiles_bf16 or 0.0, machine.gemm_bf16)
        return best, "bf16 dot (the best of vdpbf16ps, AMX's tiles and torch's bf16 GEMM)"
    return machine.fma_f32, "float32 FMA" + (" (bf16 weights widened: no bf16 GEMM here)" if fmt == "bfloat16" else "")


def workload_w() -> list[tuple[int, int]]:
    sys.path.insert(0, str(PEERS))
    from workload_w import workload_w as make

    return [(len(p), o) for p, o in make()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["50m", "250m"], default="50m")
    ap.add_argument("--format", choices=["float32", "bfloat16", "int8", "int4"], default="bfloat16")
    ap.add_argument("--measured-w", type=float, help="W's output tok/s to give as a share of the bound")
    ap.add_argument("--measured-batch1", type=float, help="batch-1 tok/s to give as a share of its bound")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    m = measure_machine()
    g = 1e9
    print(f"float32 FMA peak {m.fma_f32 / g:.0f} GFLOP/s (torch float32 GEMM {m.gemm_f32 / g:.0f}); "
          f"bf16 dot peak {f'{m.dot_bf16 / g:.0f} GFLOP/s' if m.dot_bf16 else 'none (no AVX512-BF16)'}"
          f"{f'; AMX tiles {m.tiles_bf16 / g:.0f} GFLOP/s' if m.tiles_bf16 else ''}"
          f"{f'; torch bf16 GEMM {m.gemm_bf16 / g:.0f}' if m.gemm_bf16 else ''}; "
          f"int8 dot peak {m.dot_int8 / g:.0f} GOP/s ({m.int8_name}); memory read {m.bandwidth / g:.1f} GB/s")
    dtype = "float32" if args.format == "float32" else "bfloat16"
    quant = args.format if args.format in ("int8", "int4") else "none"
    cost = model_cost(f"dummy:llama-{args.preset}", dtype, quant)
    compute, compute_name = compute_peak(m, args.format)
    work = workload_w()
    outputs = sum(o for _, o in work)
    w_floor = w_bound_seconds(cost, work, compute, m.bandwidth)
    b1_floor = batch1_bound_seconds(cost, 128 + 128, compute, m.bandwidth)
    print(f"model {args.preset} ({args.format} weights, {cost.decode_bytes / 1e6:.0f} MB read per decode step); "
          f"compute bound by {compute_name}, {compute / g:.0f} G/s")
    print(f"W bound: {outputs / w_floor:.0f} output tok/s ({w_floor:.2f} s for {outputs} tokens)"
          + (f"; measured {args.measured_w:.0f} = {args.measured_w * w_floor / outputs:.0%} of it"
             if args.measured_w else ""))
    print(f"batch-1 bound (context 256): {1 / b1_floor:.1f} tok/s"
          + (f"; measured {args.measured_batch1:.1f} = {args.measured_batch1 * b1_floor:.0%} of it"
             if args.measured_batch1 else ""))


if __name__ == "__main__":
    main()
