// The integer kernel's tiles on AVX2, where AVX512-VNNI is not built: the same sums, bit
// for bit; defines TRAVELATOR_QUANT_KERNEL where it is built.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "quant_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace travelator::quant {

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(TRAVELATOR_VEC8)
// AVX2 has no vpdpbusd; the same exact integer sums come from other instructions:
//   int8: u widened to 16 bits in place (even and odd bytes) and xi as it is (16-bit),
//         vpmaddwd: pairs of products into int32, at most 2 * 255 * 32512 each, so a block
//         of 128 inputs stays below 2^31;
//   int4: the codes' levels (at most 24: e2m1; 15 for uniform int4) widened to 16 bits in
//         place (a shift and a mask each) and xi as it is, vpmaddwd: four multiplies per 64
//         weights and row.
// The integer sums are the AVX-512 kernel's and so are the float steps, lane for lane, so a
// row comes out of both with the same bits.
#define TRAVELATOR_QUANT_KERNEL 1
constexpr int64_t kRowsPerTile = 4;  // rows of x a tile is read for at once
constexpr bool kPairTiles = false;   // a tile at a time, whatever M
constexpr int kVectors = 8;          // vectors of 8 output rows in a tile
// Vectors a pass over a block of inputs takes, whatever the rows of x (their sums may not all
// stay in registers): fewer were slower at 2 to 16 rows, 8 no faster at one.
constexpr int kPassVectors = 4;

template <typename scalar_t>
inline __m256 load8(const scalar_t* p, int64_t n) {
  if (n >= 8) return v8::load(p);
  alignas(32) float part[8] = {};
  for (int64_t i = 0; i < n; ++i) part[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(part);
}

// xi[k..k+8) as int16 in the tiles' pair order (k, k+2, k+1, k+3, k+4, k+6, k+5, k+7): see
// tile_int8 and tile_int4.
inline void store_pairs(__m256i xi, int16_t* pairs) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(xi), _mm256_extracti128_si256(xi, 1));  // |xi| <= kXMax
  const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs), _mm_shuffle_epi8(w, order));
}

template <typename scalar_t>
IntegerX integer_x(const scalar_t* x, int64_t M, int64_t K, int64_t K_padded, int64_t block) {
  IntegerX r;
  r.K = K_padded, r.block = block, r.blocks = K_padded / block;
  r.pairs.assign(M * K_padded, 0);
  r.scale.assign(M * r.blocks, 0.0f), r.sum.assign(M * r.blocks, 0);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* row = x + m * K;
    for (int64_t b = 0; b < r.blocks; ++b) {
      const int64_t k0 = b * block, k1 = std::min(K, k0 + block);
      __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; k += 8) {
        const __m256 v = load8(row + k, k1 - k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_bit, v));
      }
      if (_mm256_movemask_ps(nan)) {  // a NaN in x: the block's sums are NaN, as in float
        r.scale[m * r.blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float top = v8::max(mx);
      if (std::isinf(top)) {  // as in the AVX-512 kernel
        r.scale[m * r.blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (!(top > kXMinTop)) continue;  // as in the AVX-512 kernel: xi = 0
      const __m256 inv = _mm256_set1_ps(kXMax / top);
      const __m256i lim = _mm256_set1_epi32(kXMax), neg_lim = _mm256_set1_epi32(-kXMax);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 8) {  // k + 8 <= K_padded: lanes past k1 are 0
        // Round to nearest even (the default rounding mode), then clamp.
        __m256i xi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k, k1 - k), inv));
        xi = _mm256_max_epi32(_mm256_min_epi32(xi, lim), neg_lim);
        sum = _mm256_add_epi32(sum, xi);
        store_pairs(xi, &r.pairs[m * K_padded + k]);
      }
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      r.scale[m * r.blocks + b] = top / kXMax;
      r.sum[m * r.blocks + b] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    }
  }
  return r;
}

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The levels of a vector's 8 inputs of 8 rows as 16-bit pairs, matching x's pair order: a row's
// 32-bit lane holds bytes j = 0..3, input k + j in the low nibble and k + 4 + j in the high one,
// so its two 16-bit halves give (k, k+2) as low nibbles of their low bytes, (k+1, k+3) of their
// high bytes, (k+4, k+6) and (k+5, k+7) as the high nibbles.
template <bool E2M1>
inline void levels16(__m256i d, __m256i levels, __m256i (&u)[4]) {
  const __m256i low4 = _mm256_set1_epi16(0x000F), low8 = _mm256_set1_epi16(0x00FF);
  if constexpr (E2M1) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i l0 = _mm256_shuffle_epi8(levels, _mm256_and_si256(d, nibble));
    const __m256i l1 = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(d, 4), nibble));
    u[0] = _mm256_and_si256(l0, low8), u[1] = _mm256_srli_epi16(l0, 8);
    u[2] = _mm256_and_si256(l1, low8), u[3] = _mm256_srli_epi16(l1, 8);
  } else {
    u[0] = _mm256_and_si256(d, low4), u[1] = _mm256_and_si256(_mm256_srli_epi16(d, 8), low4);
    u[2] = _mm256_and_si256(_mm256_srli_epi16(d, 4), low4), u[3] = _mm256_srli_epi16(d, 12);
  }
}

// acc + sum of u . xi over 8 inputs: vpmaddwd of the 16-bit levels by x's pairs, each product
// at most 24 * 32512, so the int32 sums are exact.
inline __m256i dot_int4(__m256i acc, const __m256i (&u)[4], const __m256i (&xp)[4]) {
  const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(u[0], xp[0]), _mm256_madd_epi16(u[1], xp[1]));
  const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(u[2], xp[2]), _mm256_madd_epi16(u[3], xp[3]));
  return _mm256_add_epi32(acc, _mm256_add_epi32(a, b));
}

// The int4 tiles' prefetch: the 4 lines of a step 2 KB on (as in the AVX-512 kernel; 4 and 8 KB
// measured no different, nor a share of the next group at each pass's step as the int8 tiles do).
inline void prefetch_ahead(const uint8_t* wk) {
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048 + 64 * line, _MM_HINT_T0);
}

// One tile of 64 output rows (8 vectors of 8) against MR rows of x, int8 weights. A vector's
// 32 bytes are 8 rows x 4 inputs: its even bytes (k, k+2 of each row) and odd ones (k+1, k+3)
// as 16-bit lanes, times x's pairs, give each row's sum in its own lane. Each block of inputs
// (8 KB of the tile, which stays in L1) is taken in passes of kPassVectors vectors. The running float
// sums live in `out`.
template <int64_t MR>
void tile_int8(const IntegerX& xi, int64_t m0, const uint8_t* w, const float* row_scale, float* out,
               int64_t out_stride) {
  constexpr int64_t kPasses = kVectors / kPassVectors;
  const int64_t K = xi.K;
  const __m256i low8 = _mm256_set1_epi16(0x00FF);
  for (int64_t m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + m * out_stride + v * 8, _mm256_setzero_ps());
  for (int64_t b = 0; b < xi.blocks; ++b) {
    const int64_t k0 = b * xi.block;
    for (int v0 = 0; v0 < kVectors; v0 += kPassVectors) {
      __m256i acc[MR][kPassVectors];
      for (int64_t m = 0; m < MR; ++m)
        for (int v = 0; v < kPassVectors; ++v) acc[m][v] = _mm256_setzero_si256();
      // Each step of each pass prefetches its share of the next block (4 lines a step over the
      // passes): memory stays busy through every pass over this block, not the first alone.
      const char* next = reinterpret_cast<const char*>(w + (k0 + xi.block) * kTileRows);
      const int64_t first_slot = v0 / kPassVectors * (xi.block / 4);
      for (int64_t k = k0; k < k0 + xi.block; k += 4) {
        const uint8_t* wk = w + k * kTileRows;  // 8 vectors of 32 bytes
        const int64_t slot = first_slot + (k - k0) / 4;
        for (int64_t line = slot * 4 / kPasses; line < (slot + 1) * 4 / kPasses; ++line)
          _mm_prefetch(next + 64 * line, _MM_HINT_T0);
        __m256i even[MR], odd[MR];  // x's pairs (k, k+2) and (k+1, k+3) in every lane
        for (int64_t m = 0; m < MR; ++m) {
          const int16_t* at = &xi.pairs[(m0 + m) * K + k];
          even[m] = bcast4(at), odd[m] = bcast4(at + 2);
        }
        for (int v = 0; v < kPassVectors; ++v) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + (v0 + v) * 32));
          const __m256i ue = _mm256_and_si256(d, low8), uo = _mm256_srli_epi16(d, 8);
          for (int64_t m = 0; m < MR; ++m)
            acc[m][v] = _mm256_add_epi32(acc[m][v], _mm256_add_epi32(_mm256_madd_epi16(ue, even[m]),
                                                                     _mm256_madd_epi16(uo, odd[m])));
        }
      }
      for (int64_t m = 0; m < MR; ++m) {
        const int64_t mb = (m0 + m) * xi.blocks + b;
        const __m256i offset = _mm256_set1_epi32(128 * xi.sum[mb]);
        const __m256 scale = _mm256_set1_ps(xi.scale[mb]);
        for (int v = 0; v < kPassVectors; ++v) {  // sum u xi - 128 sum xi, a row a lane
          float* tot = out + m * out_stride + (v0 + v) * 8;
          const __m256 a = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][v], offset));
          _mm256_storeu_ps(tot, _mm256_fmadd_ps(a, scale, _mm256_loadu_ps(tot)));
        }
      }
    }
  }
  for (int64_t m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) {
      float* tot = out + m * out_stride + v * 8;
      _mm256_storeu_ps(tot, _mm256_mul_ps(_mm256_loadu_ps(tot), _mm256_loadu_ps(row_scale + v * 8)));
    }
}

// The same for int4 weights, groups of `group` inputs; sz: [groups][2][64] (scale, zero: GroupParam);
// codes through the e2m1 levels where E2M1 (one byte shuffle per 32 codes).
template <int64_t MR, bool E2M1>
void tile_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, const GroupParam<E2M1>* sz, float* out,
               int64_t out_stride) {
  const int64_t K = xi.K;
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Levels)));
  for (int64_t m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + m * out_stride + v * 8, _mm256_setzero_ps());
  for (int64_t g = 0; g < xi.blocks; ++g) {
    const int64_t k0 = g * xi.block;
    const GroupParam<E2M1>* s = sz + g * 2 * kTileRows;
    const GroupParam<E2M1>* z = s + kTileRows;
    for (int v0 = 0; v0 < kVectors; v0 += kPassVectors) {
      __m256i acc[MR][kPassVectors];
      for (int64_t m = 0; m < MR; ++m)
        for (int v = 0; v < kPassVectors; ++v) acc[m][v] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + xi.block; k += 8) {
        const uint8_t* wk = w + k / 2 * kTileRows;  // 8 vectors of 32 bytes: 8 inputs of 64 rows
        if (v0 == 0) prefetch_ahead(wk);
        __m256i xp[MR][4];
        for (int64_t m = 0; m < MR; ++m)
          for (int j = 0; j < 4; ++j) xp[m][j] = bcast4(&xi.pairs[(m0 + m) * K + k + 2 * j]);
        for (int v = 0; v < kPassVectors; ++v) {
          __m256i u[4];
          levels16<E2M1>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + (v0 + v) * 32)), levels, u);
          for (int64_t m = 0; m < MR; ++m) acc[m][v] = dot_int4(acc[m][v], u, xp[m]);
        }
      }
      for (int64_t m = 0; m < MR; ++m) {
        const int64_t mg = (m0 + m) * xi.blocks + g;
        const __m256i offset = _mm256_set1_epi32(8 * xi.sum[mg]);
        const __m256 xs = _mm256_set1_ps(xi.scale[mg]);
        const __m256 zx = _mm256_set1_ps(xi.scale[mg] * static_cast<float>(xi.sum[mg]));
        for (int v = 0; v < kPassVectors; ++v) {
          const int r = (v0 + v) * 8;
          float* tot = out + m * out_stride + r;
          const __m256 sxs = _mm256_mul_ps(v8::load(s + r), xs);
          __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][v], offset)), sxs, _mm256_loadu_ps(tot));
          _mm256_storeu_ps(tot, _mm256_fmadd_ps(v8::load(z + r), zx, t));
        }
      }
    }
  }
}
// One tile at a time here (kPairTiles is false).
template <int64_t MR, int64_t NT>
void tiles_int8(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t, const float* row_scale, float* out,
                int64_t out_stride, int64_t) {
  static_assert(NT == 1);
  tile_int8<MR>(xi, m0, w, row_scale, out, out_stride);
}

template <int64_t MR, int64_t NT, bool E2M1>
void tiles_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t, const GroupParam<E2M1>* sz, int64_t, float* out,
                int64_t out_stride, int64_t) {
  static_assert(NT == 1);
  tile_int4<MR, E2M1>(xi, m0, w, sz, out, out_stride);
}
#endif

}  // namespace travelator::quant
