// The integer kernel's tiles on AVX512-VNNI and AVX512-BW (vpdpbusd); defines
// TRAVELATOR_QUANT_KERNEL where it is built.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "quant_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace travelator::quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TRAVELATOR_QUANT_KERNEL 1
constexpr int64_t kRowsPerTile = 2;  // rows of x a tile is read for at once
constexpr bool kPairTiles = true;    // one row of x: tiles taken two at a time (see tiles_int8)

inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 lanes) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

template <typename scalar_t>
IntegerX integer_x(const scalar_t* x, int64_t M, int64_t K, int64_t K_padded, int64_t block) {
  IntegerX r;
  r.K = K_padded, r.block = block, r.blocks = K_padded / block;
  r.hi.assign(M * K_padded, 0), r.lo.assign(M * K_padded, 0);
  r.scale.assign(M * r.blocks, 0.0f), r.sum.assign(M * r.blocks, 0);
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* row = x + m * K;
    for (int64_t b = 0; b < r.blocks; ++b) {
      const int64_t k0 = b * block, k1 = std::min(K, k0 + block);
      __m512 mx = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (int64_t k = k0; k < k1; k += 16) {
        const __m512 v = load16(row + k, first_lanes(k1 - k));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      }
      if (nan) {  // a NaN in x: the block's sums are NaN, as in float
        r.scale[m * r.blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float top = _mm512_reduce_max_ps(mx);
      if (std::isinf(top)) {  // an infinite x: kXMax / top would be 0; the block's sums are NaN
        r.scale[m * r.blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      // All zero (or padding), or too small for kXMax / top to be finite: xi = 0.
      if (!(top > kXMinTop)) continue;
      const __m512 inv = _mm512_set1_ps(kXMax / top);
      const __m512i lim = _mm512_set1_epi32(kXMax);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 lanes = first_lanes(k1 - k);
        // Round to nearest even (the default rounding mode), then clamp.
        __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + k, lanes), inv));
        xi = _mm512_max_epi32(_mm512_min_epi32(xi, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(xi, 24), 24);  // low byte, signed
        const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(xi, lo), 8);
        _mm512_mask_cvtepi32_storeu_epi8(&r.lo[m * K_padded + k], lanes, lo);
        _mm512_mask_cvtepi32_storeu_epi8(&r.hi[m * K_padded + k], lanes, hi);
        sum = _mm512_add_epi32(sum, _mm512_maskz_mov_epi32(lanes, xi));
      }
      r.scale[m * r.blocks + b] = top / kXMax;
      r.sum[m * r.blocks + b] = _mm512_reduce_add_epi32(sum);
    }
  }
  return r;
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 4 vectors (256 bytes) of a tile 2 KB on from wk: the hardware prefetcher alone falls
// behind on a tile's stream (nearer or farther ahead measured slower).
inline void prefetch_ahead(const uint8_t* wk) {
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048 + 64 * line, _MM_HINT_T0);
}

// A block's exact sum over its inputs of u xi = 256 (u . hi) + (u . lo), less `offset`.
inline __m512i block_sum(__m512i u_hi, __m512i u_lo, __m512i offset) {
  return _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(u_hi, 8), u_lo), offset);
}

// NT adjacent tiles of 64 output rows (tile j at w + j * tile_bytes, its rows' scales at
// row_scale + 64 j, its sums at out + j * tile_out) against MR rows of x (rows m0..m0+MR-1),
// int8 weights. Two tiles at once for one row of x: two streams in flight read
// memory faster than one; each tile's sums are the same instructions in the same order.
template <int64_t MR, int64_t NT>
void tiles_int8(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t tile_bytes, const float* row_scale,
                float* out, int64_t out_stride, int64_t tile_out) {
  const int64_t K = xi.K;
  __m512 tot[NT][MR][4];
  for (int64_t j = 0; j < NT; ++j)
    for (int64_t m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r) tot[j][m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < xi.blocks; ++b) {
    __m512i ah[NT][MR][4], al[NT][MR][4];
    for (int64_t j = 0; j < NT; ++j)
      for (int64_t m = 0; m < MR; ++m)
        for (int r = 0; r < 4; ++r) ah[j][m][r] = al[j][m][r] = _mm512_setzero_si512();
    const int64_t k0 = b * xi.block;
    for (int64_t k = k0; k < k0 + xi.block; k += 4) {
      __m512i bh[MR], bl[MR];
      for (int64_t m = 0; m < MR; ++m) {
        bh[m] = bcast4(&xi.hi[(m0 + m) * K + k]);
        bl[m] = bcast4(&xi.lo[(m0 + m) * K + k]);
      }
      for (int64_t j = 0; j < NT; ++j) {
        const uint8_t* wk = w + j * tile_bytes + k * kTileRows;  // 4 vectors of 64 bytes
        prefetch_ahead(wk);
        for (int r = 0; r < 4; ++r) {
          const __m512i wv = _mm512_loadu_si512(wk + r * 64);
          for (int64_t m = 0; m < MR; ++m) {
            ah[j][m][r] = _mm512_dpbusd_epi32(ah[j][m][r], wv, bh[m]);
            al[j][m][r] = _mm512_dpbusd_epi32(al[j][m][r], wv, bl[m]);
          }
        }
      }
    }
    for (int64_t m = 0; m < MR; ++m) {
      const int64_t mb = (m0 + m) * xi.blocks + b;
      const __m512i offset = _mm512_set1_epi32(128 * xi.sum[mb]);
      const __m512 xs = _mm512_set1_ps(xi.scale[mb]);
      for (int64_t j = 0; j < NT; ++j)
        for (int r = 0; r < 4; ++r) {
          const __m512i a = block_sum(ah[j][m][r], al[j][m][r], offset);
          tot[j][m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), xs, tot[j][m][r]);
        }
    }
  }
  for (int64_t j = 0; j < NT; ++j)
    for (int64_t m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r)
        _mm512_storeu_ps(out + j * tile_out + m * out_stride + r * 16,
                         _mm512_mul_ps(tot[j][m][r], _mm512_loadu_ps(row_scale + j * kTileRows + r * 16)));
}

// The same for int4 weights, groups of `group` inputs; sz: [groups][2][64] (scale, zero: GroupParam),
// tile j's at sz + j * tile_sz; codes through the e2m1 levels where E2M1.
template <int64_t MR, int64_t NT, bool E2M1>
void tiles_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t tile_bytes, const GroupParam<E2M1>* sz,
                int64_t tile_sz, float* out, int64_t out_stride, int64_t tile_out) {
  const int64_t K = xi.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Levels)));
  __m512 tot[NT][MR][4];
  for (int64_t j = 0; j < NT; ++j)
    for (int64_t m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r) tot[j][m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < xi.blocks; ++g) {
    __m512i ah[NT][MR][4], al[NT][MR][4];
    for (int64_t j = 0; j < NT; ++j)
      for (int64_t m = 0; m < MR; ++m)
        for (int r = 0; r < 4; ++r) ah[j][m][r] = al[j][m][r] = _mm512_setzero_si512();
    const int64_t k0 = g * xi.block;
    for (int64_t k = k0; k < k0 + xi.block; k += 8) {
      __m512i bh0[MR], bl0[MR], bh1[MR], bl1[MR];
      for (int64_t m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * K + k;
        bh0[m] = bcast4(&xi.hi[at]), bl0[m] = bcast4(&xi.lo[at]);
        bh1[m] = bcast4(&xi.hi[at + 4]), bl1[m] = bcast4(&xi.lo[at + 4]);
      }
      for (int64_t j = 0; j < NT; ++j) {
        const uint8_t* wk = w + j * tile_bytes + k / 2 * kTileRows;  // 4 vectors of 64 bytes: 8 inputs of 64 rows
        prefetch_ahead(wk);
        for (int r = 0; r < 4; ++r) {
          const __m512i wv = _mm512_loadu_si512(wk + r * 64);
          __m512i lo = _mm512_and_si512(wv, nibble);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nibble);
          if constexpr (E2M1) lo = _mm512_shuffle_epi8(levels, lo), hi = _mm512_shuffle_epi8(levels, hi);
          for (int64_t m = 0; m < MR; ++m) {
            ah[j][m][r] = _mm512_dpbusd_epi32(ah[j][m][r], lo, bh0[m]);
            al[j][m][r] = _mm512_dpbusd_epi32(al[j][m][r], lo, bl0[m]);
            ah[j][m][r] = _mm512_dpbusd_epi32(ah[j][m][r], hi, bh1[m]);
            al[j][m][r] = _mm512_dpbusd_epi32(al[j][m][r], hi, bl1[m]);
          }
        }
      }
    }
    for (int64_t m = 0; m < MR; ++m) {
      const int64_t mg = (m0 + m) * xi.blocks + g;
      const __m512i offset = _mm512_set1_epi32(8 * xi.sum[mg]);
      const __m512 xs = _mm512_set1_ps(xi.scale[mg]);
      const __m512 zx = _mm512_set1_ps(xi.scale[mg] * static_cast<float>(xi.sum[mg]));
      for (int64_t j = 0; j < NT; ++j) {
        const GroupParam<E2M1>* s = sz + j * tile_sz + g * 2 * kTileRows;
        const GroupParam<E2M1>* z = s + kTileRows;
        for (int r = 0; r < 4; ++r) {
          const __m512i a = block_sum(ah[j][m][r], al[j][m][r], offset);
          const __m512 sxs = _mm512_mul_ps(vec16::load(s + r * 16), xs);
          tot[j][m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sxs, tot[j][m][r]);
          tot[j][m][r] = _mm512_fmadd_ps(vec16::load(z + r * 16), zx, tot[j][m][r]);
        }
      }
    }
  }
  for (int64_t j = 0; j < NT; ++j)
    for (int64_t m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + j * tile_out + m * out_stride + r * 16, tot[j][m][r]);
}

#endif

}  // namespace travelator::quant
