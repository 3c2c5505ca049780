// y = x W^T (+ bias) in bf16 with float32 sums, on CPUs with AVX512-BF16 and no AMX (AMD
// Zen 4/5, Intel Cooper Lake), with W laid out once at load as [N / 64][K / 2][64][2]: for
// each 64 output columns, every pair of k in order, the 64 columns' two weights side by
// side. One 512-bit load is then 16 columns' pair, the operand vdpbf16ps wants, and a
// block of 64 columns is one front-to-back stream of memory.
//
// The micro-kernel keeps 6 rows x 64 columns of sums in 24 registers; per pair of k it
// loads 4 weight vectors and broadcasts each row's pair of x. Blocks of 64 columns are
// split over threads; k is taken kKeyPairs pairs at a time (a 64 KB slice of a block, kept
// in L2 while every row passes over it). On a 2-core Zen 5 it runs 1.1-2.5x oneDNN's packed
// bf16 GEMM from 8 to 128 rows and level with it past that (docs/benchmarks.md). oneDNN's
// AMX GEMM is far faster on CPUs that have AMX: there this kernel is not built.
//
// Each output is summed over k in order, the same way whatever M is and however the rows
// and columns are split: a row's result never depends on the other rows of x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 64;  // output columns of a block: four 16-lane vectors
constexpr int64_t kRows = 6;   // rows of x a micro-kernel call takes: 24 accumulators
constexpr int64_t kKeyPairs = 256;  // pairs of k a pass takes: 64 KB of a block

// acc[r][0..64) += sum over pairs p < n_pairs of x[r] pair p . w pair p, R rows.
template <int64_t R>
inline void micro(const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc) {
  __m512 a[R][4];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc + r * kCols + 16 * j);
  for (int64_t p = 0; p < n_pairs; ++p) {
    const __m512bh w0 = w[4 * p], w1 = w[4 * p + 1], w2 = w[4 * p + 2], w3 = w[4 * p + 3];
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + p]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], xr, w0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], xr, w1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], xr, w2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], xr, w3);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kCols + 16 * j, a[r][j]);
}

template <int64_t R = kRows>
inline void micro_any(int64_t rows, const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc) {
  if constexpr (R > 1) {
    if (rows < R) return micro_any<R - 1>(rows, x, x_stride, w, n_pairs, acc);
  }
  micro<R>(x, x_stride, w, n_pairs, acc);
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "blocked_linear: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(2) == kCols &&
                  w.size(3) == 2,
              "blocked_linear: w must be a blocked bf16 weight [N / 64, K / 2, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = w.size(1), N = w.size(0) * kCols;
  TORCH_CHECK(K == 2 * K2, "blocked_linear: x has ", K, " columns, the weight ", 2 * K2);
  const float* b = nullptr;
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "blocked_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const __m512bh*>(w.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kCols);
    for (int64_t nb = begin; nb < end; ++nb) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const __m512bh* block = wp + nb * K2 * 4;  // 4 vectors a pair
      for (int64_t p0 = 0; p0 < K2; p0 += kKeyPairs) {
        const int64_t n_pairs = std::min(kKeyPairs, K2 - p0);
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          micro_any(std::min(kRows, M - m0), xp + m0 * K2 + p0, K2, block + 4 * p0, n_pairs, &acc[m0 * kCols]);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < 4; ++j) {
          __m512 v = _mm512_loadu_ps(&acc[m * kCols + 16 * j]);
          if (b != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(b + nb * kCols + 16 * j));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * N + nb * kCols + 16 * j),
                              (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  // x [M, K] bf16, w from blocked_linear_weight (model/ops.py), bias [N] or None.
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("blocked_linear", c10::DispatchKey::CPU, &blocked_linear);
}
#endif
