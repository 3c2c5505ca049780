// y = x W^T for one or two rows of x (a decode step of one or two requests), bf16 weights
// in their natural [N, K] layout. At these sizes the step only streams the weights, and
// oneDNN's blocked GEMM reaches about 75% of the machine's read bandwidth here; reading
// each weight row front to back, four rows at a time, with vdpbf16ps (bf16 pairs into
// float32 sums) and the next rows prefetched, runs at about the bandwidth of a plain sum.
//
// Every output is summed over K in the same order whatever M is and however N is split
// over threads, so a row's result does not depend on the other rows of x.
//
// Registered only where the compiler targets AVX512-BF16; the Python side falls back to
// oneDNN elsewhere.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

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
  // few lines in flight for four interleaved rows (15.6 -> 19-20 GB/s here). Past the last
  // row the addresses run beyond the weight, which a prefetch may do: it never faults.
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
  switch (M) {
    case 1: rows<1>(xp, wp, yp, K, N); break;
    default: rows<2>(xp, wp, yp, K, N); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("small_m_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
}
#endif
