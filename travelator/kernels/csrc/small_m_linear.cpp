// y = x W^T for a few rows of x (a decode step of one to a few requests), bf16 weights
// in their natural [N, K] layout. At these sizes the step only streams the weights, and
// the GEMM libraries read them well below the machine's bandwidth (oneDNN's blocked GEMM on
// AVX512-BF16 machines; on AVX2 machines, which have no bf16 GEMM, torch's float32 GEMM over
// widened weights). Reading each weight row front to back, a few rows at a time, with the
// next rows prefetched, runs closer to the bandwidth of a sum (docs/benchmarks.md).
//
// Two builds of the same loop:
// - AVX512-BF16: 32 lanes a step, vdpbf16ps (bf16 pairs into float32 sums); up to 2 rows
//   (past them oneDNN's AMX GEMM is faster).
// - AVX2 + FMA (vec8.h): 8 lanes a step, each bf16 widened to float32 (a shift: exact), then FMA;
//   up to 4 rows (past them float32 GEMM over widened weights wins).
// Every output is summed over K in the same order whatever M is and however N is split
// over threads, so a row's result does not depend on the other rows of x.
//
// Not registered on other CPUs; the Python side then uses the GEMM library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec8.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kMaxRows = 2;  // past two rows oneDNN's AMX GEMM is faster here
constexpr int64_t kOutTile = 4;  // weight rows read together
constexpr int64_t kAhead = kOutTile;  // prefetch distance in weight rows: the next tile

// K lanes [k, k + 32) of a bf16 row as 16 pairs; lanes at or past `left` read as zero.
inline __m512bh load_pairs(const c10::BFloat16* p, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
  const __mmask32 lanes = static_cast<__mmask32>((1ull << left) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(lanes, p);
}

template <int64_t M, int64_t R>
void tile(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N,
          int64_t n0) {
  __m512 acc[M][R];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  // The next tile's weight rows, kAhead rows on: the hardware prefetcher alone keeps too
  // few lines in flight for four interleaved rows. Past the last row the addresses run
  // beyond the weight, which a prefetch may do: it never faults.
  const char* ahead = reinterpret_cast<const char*>(w + std::min(n0 + kAhead, N - 1) * K);
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r) {
      _mm_prefetch(ahead + (r * K + k) * 2, _MM_HINT_T0);
      wv[r] = load_pairs(w + (n0 + r) * K + k, K - k);
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh xv = load_pairs(x + m * K + k, K - k);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) y[m * N + n0 + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[m][r]));
}

template <int64_t M>
void rows(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N) {
  // Chunks of 64 output rows: enough work per task, and the split never changes a sum.
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t stop = std::min(N, (chunk + 1) * 64);
      int64_t n = chunk * 64;
      for (; n + kOutTile <= stop; n += kOutTile) tile<M, kOutTile>(x, w, y, K, N, n);
      for (; n < stop; ++n) tile<M, 1>(x, w, y, K, N, n);
    }
  });
}

void small_m_kernel(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t M, int64_t K,
                    int64_t N) {
  if (M == 1) rows<1>(x, w, y, K, N);
  else rows<2>(x, w, y, K, N);
}

}  // namespace
#elif defined(TRAVELATOR_VEC8)
namespace {
namespace v8 = travelator::vec8;

constexpr int64_t kMaxRows = 4;

// xf: x widened to float32, [M][K]. Lanes k < K8 (a multiple of 8) in vectors, the rest
// after them in order, so every output has one summation order.
template <int64_t M, int64_t R>
void tile(const float* xf, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N, int64_t n0) {
  const int64_t K8 = K / 8 * 8;
  __m256 acc[M][R];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  // The next tile's rows (R on), a line per 32 lanes.
  const char* ahead = reinterpret_cast<const char*>(w + std::min(n0 + R, N - 1) * K);
  // Four steps per loop: one cache line of each row (0.65-0.70 -> 0.68-0.79 of a sum's rate).
#pragma GCC unroll 4
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[R];
    for (int64_t r = 0; r < R; ++r) {
      if ((k & 31) == 0) _mm_prefetch(ahead + (r * K + k) * 2, _MM_HINT_T0);  // a line per 32 lanes
      wv[r] = v8::load(w + (n0 + r) * K + k);
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * K + k);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      float sum = v8::sum(acc[m][r]);
      const c10::BFloat16* wr = w + (n0 + r) * K;
      for (int64_t k = K8; k < K; ++k) sum += xf[m * K + k] * static_cast<float>(wr[k]);
      y[m * N + n0 + r] = c10::BFloat16(sum);
    }
}

template <int64_t M>
void rows(const float* xf, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N) {
  constexpr int64_t R = M <= 2 ? 4 : 2;  // accumulators and weights within the 16 registers
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t stop = std::min(N, (chunk + 1) * 64);
      int64_t n = chunk * 64;
      for (; n + R <= stop; n += R) tile<M, R>(xf, w, y, K, N, n);
      for (; n < stop; ++n) tile<M, 1>(xf, w, y, K, N, n);
    }
  });
}

void small_m_kernel(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t M, int64_t K,
                    int64_t N) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  switch (M) {
    case 1: rows<1>(xf.data(), w, y, K, N); break;
    case 2: rows<2>(xf.data(), w, y, K, N); break;
    case 3: rows<3>(xf.data(), w, y, K, N); break;
    default: rows<4>(xf.data(), w, y, K, N); break;
  }
}

}  // namespace
#endif

#if defined(__AVX512BF16__) || defined(TRAVELATOR_VEC8)
namespace {

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_m_linear: bad shapes");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_m_linear: bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_m_linear: contiguous inputs only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_m_linear: 1 to ", kMaxRows, " rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  small_m_kernel(xp, wp, yp, M, K, N);
  return y;
}

int64_t small_m_linear_rows() { return kMaxRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("small_m_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
  // The most rows of x this build takes.
  m.def("small_m_linear_rows() -> int", &small_m_linear_rows);
}
#endif
