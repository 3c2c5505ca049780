// y = x W^T (+ bias) in bf16 with float32 sums, on CPUs with AVX512-BF16 and no AMX, with W laid out once at load as [N / 64][K / 2][64][2]: for
// each 64 output columns, every pair of k in order, the 64 columns' two weights side by
// side. One 512-bit load is then 16 columns' pair, the operand vdpbf16ps wants, and a
// block of 64 columns is one front-to-back stream of memory.
//
// The micro-kernel keeps 6 rows x 64 columns of sums in 24 registers; per pair of k it
// loads 4 weight vectors and broadcasts each row's pair of x. Blocks of 64 columns are
// split over threads; k is taken a slice of a block at a time (16 KB, kept in L1, for a
// tile of up to three groups of rows; 64 KB, kept in L2, past that), every group of rows
// passing over it, and while a slice is computed the next one is asked for into L2: a
// decode step's few rows then compute while the weights stream in, where without it the
// two took turns. It beats oneDNN's packed bf16 GEMM at a decode step's rows and keeps up
// with it on long prefills (docs/benchmarks.md). oneDNN's AMX GEMM is faster on CPUs that
// have AMX: there this kernel is not built.
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
constexpr int64_t kKeyPairs = 256;  // pairs of k a pass takes (64 KB of a block), past kFewGroups groups
// With at most kFewGroups groups of rows, a pass takes kFewGroupPairs pairs (16 KB), which
// stays in L1 while the groups after the first pass over it (12 rows, 6 + 6, where only the
// slice changed). More groups amortise their accumulators' loads and stores better over the
// longer pass.
constexpr int64_t kFewGroups = 3;
constexpr int64_t kFewGroupPairs = 64;
constexpr int64_t kRowTileBytes = 384 << 10;  // rows of x taken together: at most this much of x, kept in L2

// acc[r][0..64) += sum over pairs p < n_pairs of x[r] pair p . w pair p, R rows.
// ahead, lines: lines of weights to ask for into L2 meanwhile, spread over the pairs.
template <int64_t R>
inline void micro(const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc,
                  const __m512bh* ahead, int64_t lines) {
  const int64_t per_pair = (lines + n_pairs - 1) / n_pairs;
  __m512 a[R][4];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc + r * kCols + 16 * j);
  for (int64_t p = 0; p < n_pairs; ++p) {
    for (int64_t i = p * per_pair, stop = std::min(lines, (p + 1) * per_pair); i < stop; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T1);
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
inline void micro_any(int64_t rows, const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc,
                      const __m512bh* ahead, int64_t lines) {
  if constexpr (R > 1) {
    if (rows < R) return micro_any<R - 1>(rows, x, x_stride, w, n_pairs, acc, ahead, lines);
  }
  micro<R>(x, x_stride, w, n_pairs, acc, ahead, lines);
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "blocked_linear: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(2) == kCols &&
                  w.size(3) == 2,
              "blocked_linear: w must be a blocked bf16 weight [N / 64, K / 2, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = w.size(1), N = w.size(0) * kCols;
  TORCH_CHECK(K == 2 * K2, "blocked_linear: x has ", K, " columns, the weight ", 2 * K2);
  TORCH_CHECK(K2 > 0, "blocked_linear: no columns in x");
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
  const __m512bh* w_end = wp + N / kCols * K2 * 4;
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Rows of x are taken a tile at a time, each tile against every block of this thread's
  // columns, so that the tile is read from L2 (many rows: a prefill chunk) and a block's
  // weights once per tile (few rows: a decode step has one tile).
  const int64_t row_tile = std::max<int64_t>(kRows, kRowTileBytes / (2 * K) / kRows * kRows);
  at::parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(M, row_tile) * kCols);
    for (int64_t t0 = 0; t0 < M; t0 += row_tile) {
      const int64_t tile_rows = std::min(row_tile, M - t0);
      // Rows are dealt out evenly (13 rows: 5, 4, 4, not 6, 6, 1): a group of few rows has
      // too few independent sums to hide vdpbf16ps's latency, so it costs nearly a full one.
      const int64_t groups = (tile_rows + kRows - 1) / kRows;
      const int64_t base = tile_rows / groups, extra = tile_rows % groups;
      const int64_t pass_pairs = groups <= kFewGroups ? kFewGroupPairs : kKeyPairs;
      for (int64_t nb = begin; nb < end; ++nb) {
        const __m512bh* block = wp + nb * K2 * 4;  // 4 vectors a pair
        std::fill(acc.begin(), acc.begin() + tile_rows * kCols, 0.0f);
        for (int64_t p0 = 0; p0 < K2; p0 += pass_pairs) {
          const int64_t n_pairs = std::min(pass_pairs, K2 - p0);
          // The weights after this pass (the next pass, or the next block: they follow in
          // memory, up to the weight's end), asked for into L2 while this pass computes, a
          // share in each group of rows. A vector is a line: 4 lines a pair.
          const __m512bh* next = block + 4 * (p0 + n_pairs);
          const int64_t lines = std::min<int64_t>(4 * pass_pairs, w_end - next);
          const int64_t share = (lines + groups - 1) / groups;
          for (int64_t g = 0, m0 = 0; g < groups; ++g) {
            const int64_t rows = base + (g < extra ? 1 : 0);
            micro_any(rows, xp + (t0 + m0) * K2 + p0, K2, block + 4 * p0, n_pairs, &acc[m0 * kCols],
                      next + std::min(lines, g * share), std::max<int64_t>(0, std::min(share, lines - g * share)));
            m0 += rows;
          }
        }
        for (int64_t m = 0; m < tile_rows; ++m)
          for (int64_t j = 0; j < 4; ++j) {
            __m512 v = _mm512_loadu_ps(&acc[m * kCols + 16 * j]);
            if (b != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(b + nb * kCols + 16 * j));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (t0 + m) * N + nb * kCols + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  // x [M, K] bf16, w from blocked_linear_weight (model/native_linear.py), bias [N] or None.
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("blocked_linear", c10::DispatchKey::CPU, &blocked_linear);
}
#endif
