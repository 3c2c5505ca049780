// The tiles of small_m_linear (y = x W^T for a few rows of x, bf16 weights in their natural
// [N, K] layout), shared by small_m_linear.cpp and moe_experts.cpp. See small_m_linear.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include "vec8.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace travelator::small_m {

// Past four rows oneDNN's AMX GEMM makes the step faster: the tiles' dot products, not the
// weights' bytes, then bound it (docs/benchmarks.md).
constexpr int64_t kMaxRows = 4;
using XRow = c10::BFloat16;  // the tiles read x as it is
constexpr int64_t kOutTile = 4;  // weight rows read together
constexpr int64_t kAhead = kOutTile;  // prefetch distance in weight rows: the next tile
constexpr int64_t kChunk = 64;  // output rows per task

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

// Output rows [64 chunk, 64 chunk + 64) of y = x W^T: the unit of work of every caller, so
// a split over threads never changes a sum.
template <int64_t M>
void chunk_of(const XRow* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N, int64_t chunk) {
  const int64_t stop = std::min(N, (chunk + 1) * kChunk);
  int64_t n = chunk * kChunk;
  for (; n + kOutTile <= stop; n += kOutTile) tile<M, kOutTile>(x, w, y, K, N, n);
  for (; n < stop; ++n) tile<M, 1>(x, w, y, K, N, n);
}

inline void chunk(const XRow* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t M, int64_t K, int64_t N,
                  int64_t c) {
  switch (M) {
    case 1: return chunk_of<1>(x, w, y, K, N, c);
    case 2: return chunk_of<2>(x, w, y, K, N, c);
    case 3: return chunk_of<3>(x, w, y, K, N, c);
    default: return chunk_of<4>(x, w, y, K, N, c);
  }
}

// x as the tiles read it.
inline void widen(const c10::BFloat16* x, XRow* out, int64_t n) { std::copy(x, x + n, out); }

}  // namespace travelator::small_m
#elif defined(TRAVELATOR_VEC8)
namespace travelator::small_m {
namespace v8 = travelator::vec8;

constexpr int64_t kMaxRows = 4;
using XRow = float;  // the tiles read x widened to float32 (see widen)

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

constexpr int64_t kChunk = 64;  // output rows per task

// Output rows [64 chunk, 64 chunk + 64) of y = x W^T: the unit of work of every caller, so
// a split over threads never changes a sum.
template <int64_t M>
void chunk_of(const float* xf, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N, int64_t chunk) {
  constexpr int64_t R = M <= 2 ? 4 : 2;  // accumulators and weights within the 16 registers
  const int64_t stop = std::min(N, (chunk + 1) * kChunk);
  int64_t n = chunk * kChunk;
  for (; n + R <= stop; n += R) tile<M, R>(xf, w, y, K, N, n);
  for (; n < stop; ++n) tile<M, 1>(xf, w, y, K, N, n);
}

inline void chunk(const float* xf, const c10::BFloat16* w, c10::BFloat16* y, int64_t M, int64_t K, int64_t N,
                  int64_t c) {
  switch (M) {
    case 1: chunk_of<1>(xf, w, y, K, N, c); break;
    case 2: chunk_of<2>(xf, w, y, K, N, c); break;
    case 3: chunk_of<3>(xf, w, y, K, N, c); break;
    default: chunk_of<4>(xf, w, y, K, N, c); break;
  }
}

// x as the tiles read it: widened to float32 (exact).
inline void widen(const c10::BFloat16* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

}  // namespace travelator::small_m
#endif

