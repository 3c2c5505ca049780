// y = x W^T (+ bias) for bf16 x and W on AVX2 + FMA CPUs, which have no bf16 GEMM: each bf16
// product is exact in float32, so widening both sides and summing in float32 is a bf16 GEMM
// with float32 sums, as oneDNN's is where it has one. W is laid out once at load in panels of
// 16 output columns, [N / 16][K][16], and stays bf16: half the bytes of a float32 copy.
//
// The micro-kernel keeps 6 rows x 16 columns of sums in 12 registers (two weight vectors and
// one broadcast of x take 3 more of the 16). Rows of x are widened a tile at a time (kept in
// L2); a panel's weights are widened a slice of k at a time into a buffer that stays in L1
// while every group of 6 rows of the tile passes over it. Panels are split over threads.
//
// A step of a few rows (kStreamRows at most) only streams the weights: stream_panels reads
// several panels side by side, front to back, with no slices.
//
// Each output is a float32 sum over k in order, one fused multiply-add per k: whatever M is
// and however rows and columns are split, a row's result never depends on the other rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "dynamic_split.h"
#include "vec8.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(TRAVELATOR_VEC8)
namespace {

namespace v8 = travelator::vec8;

constexpr int64_t kCols = 16;  // a panel: two 8-lane vectors
constexpr int64_t kRows = 6;   // rows of a group: 12 accumulators
constexpr int64_t kSlice = 256;  // k a pass takes: a widened panel slice of 16 KB, kept in L1
constexpr int64_t kTileBytes = 384 << 10;  // widened rows of x taken together, kept in L2
constexpr int64_t kMinTileRows = 16 * kRows;  // so a panel slice, widened once, serves many groups
constexpr int64_t kFewGroups = 3;  // up to this many groups of rows read the bf16 panel directly

// x[0, n) widened to float32 (exact).
void widen(const c10::BFloat16* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v8::store(out + i, v8::load(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// acc[r][0..16) += sum over k < kc of a[r][k] * b[k][0..16), for R rows of a (row stride lda);
// b float32 (a widened slice) or bf16 (the panel itself, widened in registers).
template <int64_t R, typename B>
inline void micro(const float* a, int64_t lda, const B* b, int64_t kc, float* acc) {
  __m256 s[R][2];
  for (int64_t r = 0; r < R; ++r) {
    s[r][0] = _mm256_loadu_ps(acc + r * kCols);
    s[r][1] = _mm256_loadu_ps(acc + r * kCols + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = v8::load(b + k * kCols), b1 = v8::load(b + k * kCols + 8);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);
      s[r][0] = _mm256_fmadd_ps(ar, b0, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(ar, b1, s[r][1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kCols, s[r][0]);
    _mm256_storeu_ps(acc + r * kCols + 8, s[r][1]);
  }
}

template <int64_t R = kRows, typename B>
inline void micro_rows(int64_t rows, const float* a, int64_t lda, const B* b, int64_t kc, float* acc) {
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<R - 1>(rows, a, lda, b, kc, acc);
  }
  micro<R>(a, lda, b, kc, acc);
}

// Up to this many rows of x, the weights are streamed (stream_panels) rather than tiled.
constexpr int64_t kStreamRows = 4;
constexpr int64_t kStreamPanels = 4;  // the most panels stream_step takes side by side
constexpr int64_t kAhead = 1024;  // bytes prefetched ahead in each panel's stream

// sums of P panels (consecutive, from `panels`) for M rows of x widened (xw, [M][K]), each
// (row, column) its own chain of fused multiply-adds over k in order, as micro's, so the bits
// are micro's. A panel's 16 bf16 columns at k are one 32-byte load: as 32-bit lanes the odd
// columns are the high halves (masked) and the even ones the low halves (shifted), two
// instructions for 16 weights. Writes out[(m P + q) 16 + column].
template <int64_t M, int64_t P>
void stream_panels(const float* xw, int64_t K, const c10::BFloat16* panels, float* out) {
  constexpr int64_t A = M * P;  // sums[2 a]: the even columns of pair a = (m, q), sums[2 a + 1] the odd
  __m256 sums[2 * A];
#pragma GCC unroll 16
  for (int64_t i = 0; i < 2 * A; ++i) sums[i] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[2 * P];
#pragma GCC unroll 8
    for (int64_t q = 0; q < P; ++q) {
      const c10::BFloat16* at = panels + (q * K + k) * kCols;
      // Every k, not every other (a line holds two): a branch here made gcc keep the sums in memory.
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      w[2 * q] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      w[2 * q + 1] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    }
#pragma GCC unroll 8
    for (int64_t m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xw + m * K + k);
#pragma GCC unroll 16
      for (int64_t j = 0; j < 2 * P; ++j) sums[2 * m * P + j] = _mm256_fmadd_ps(xv, w[j], sums[2 * m * P + j]);
    }
  }
#pragma GCC unroll 16
  for (int64_t a = 0; a < A; ++a) {  // back to column order: even and odd lanes interleaved
    const __m256 lo = _mm256_unpacklo_ps(sums[2 * a], sums[2 * a + 1]);
    const __m256 hi = _mm256_unpackhi_ps(sums[2 * a], sums[2 * a + 1]);
    _mm256_storeu_ps(out + a * kCols, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(out + a * kCols + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// Panels side by side for `rows` rows: as many as the 16 registers hold sums for (4 for one
// row, 2 for two; rows x panels <= 4), fewer at the end of a piece of the split (one row:
// all that are left, so that more chains stay in flight). Returns how many it took.
int64_t stream_step(int64_t rows, const float* xw, int64_t K, const c10::BFloat16* panels, int64_t left,
                    float* out) {
  switch (rows) {
    case 1:
      if (left >= 4) return stream_panels<1, 4>(xw, K, panels, out), 4;
      if (left == 3) return stream_panels<1, 3>(xw, K, panels, out), 3;
      if (left == 2) return stream_panels<1, 2>(xw, K, panels, out), 2;
      return stream_panels<1, 1>(xw, K, panels, out), 1;
    case 2:
      if (left >= 2) return stream_panels<2, 2>(xw, K, panels, out), 2;
      return stream_panels<2, 1>(xw, K, panels, out), 1;
    case 3: return stream_panels<3, 1>(xw, K, panels, out), 1;
    default: return stream_panels<4, 1>(xw, K, panels, out), 1;
  }
}

struct Problem {
  const c10::BFloat16* w;  // [N / 16][K][16]
  const float* bias;       // [N] or null
  c10::BFloat16* y;        // [M][N]
  int64_t K, N;
};

// y[m0 + m][column] for the P panels from nb on, from sums as stream_panels writes them.
void store_streamed(const Problem& p, const float* sums, int64_t m0, int64_t rows, int64_t nb, int64_t P) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t q = 0; q < P; ++q)
      for (int64_t j = 0; j < kCols; j += 8) {
        __m256 s = _mm256_loadu_ps(sums + (m * P + q) * kCols + j);
        if (p.bias != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(p.bias + (nb + q) * kCols + j));
        v8::store(p.y + (m0 + m) * p.N + (nb + q) * kCols + j, s);
      }
}

// Rows [m0, m0 + rows) of y for panels [begin, end), from those rows of x widened.
void tile(const Problem& p, const float* xw, int64_t m0, int64_t rows, int64_t begin, int64_t end) {
  if (rows <= kStreamRows) {
    float sums[kStreamRows * kCols];  // stream_step takes rows x panels <= 4
    for (int64_t nb = begin; nb < end;) {
      const int64_t P = stream_step(rows, xw, p.K, p.w + nb * p.K * kCols, end - nb, sums);
      store_streamed(p, sums, m0, rows, nb, P);
      nb += P;
    }
    return;
  }
  alignas(64) float slice[kSlice * kCols];
  std::vector<float> acc(rows * kCols);
  // Rows dealt out evenly (8 rows: 4 and 4, not 6 and 2): a group of few rows has too few
  // independent sums to hide the multiply-add's latency, so it costs nearly a full one.
  const int64_t groups = (rows + kRows - 1) / kRows, base = rows / groups, extra = rows % groups;
  // Few groups: widening a slice once would serve too few of them; each widens it in registers.
  const bool widen_slices = groups > kFewGroups;
  for (int64_t nb = begin; nb < end; ++nb) {
    const c10::BFloat16* panel = p.w + nb * p.K * kCols;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k0 = 0; k0 < p.K; k0 += kSlice) {
      const int64_t kc = std::min(kSlice, p.K - k0);
      if (widen_slices)
        for (int64_t i = 0; i < kc * kCols; i += 8) v8::store(slice + i, v8::load(panel + k0 * kCols + i));
      for (int64_t g = 0, r0 = 0; g < groups; ++g) {
        const int64_t n = base + (g < extra ? 1 : 0);
        if (widen_slices)
          micro_rows(n, xw + r0 * p.K + k0, p.K, slice, kc, acc.data() + r0 * kCols);
        else
          micro_rows(n, xw + r0 * p.K + k0, p.K, panel + k0 * kCols, kc, acc.data() + r0 * kCols);
        r0 += n;
      }
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < kCols; j += 8) {
        __m256 s = _mm256_loadu_ps(&acc[m * kCols + j]);
        if (p.bias != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(p.bias + nb * kCols + j));
        v8::store(p.y + (m0 + m) * p.N + nb * kCols + j, s);
      }
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "panel_linear: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(2) == kCols,
              "panel_linear: w must be a panel bf16 weight [N / 16, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kCols;
  TORCH_CHECK(w.size(1) == K, "panel_linear: x has ", K, " columns, the weight ", w.size(1));
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "panel_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Problem p{w.data_ptr<c10::BFloat16>(), bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                  y.data_ptr<c10::BFloat16>(), K, N};
  const auto* xp = x.data_ptr<c10::BFloat16>();
  // Rows a tile at a time, every panel passing over a tile: the widened tile is read from L2.
  const int64_t tile_rows = std::max(kMinTileRows, kTileBytes / (4 * std::max<int64_t>(K, 1)) / kRows * kRows);
  std::vector<float> xw(std::min(M, tile_rows) * K);
  for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, M - m0);
    widen(xp + m0 * K, rows * K, xw.data());
    // A streamed step of one or two rows reads 4 / rows panels side by side.
    const int64_t side_by_side = rows > kStreamRows ? 1 : std::max<int64_t>(1, kStreamPanels / rows);
    travelator::dynamic_split(N / kCols, side_by_side, [&](int64_t begin, int64_t end) {
      tile(p, xw.data(), m0, rows, begin, end);
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  // x [M, K] bf16, w from panel_linear_weight (model/native_linear.py), bias [N] or None.
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
}
#endif
