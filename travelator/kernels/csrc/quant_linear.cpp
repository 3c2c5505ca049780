// y = x W^T for a few rows of x against int8 or int4 weights kept quantized
// (``--quantization int8|int4``): a decode step of one or a few requests, which only streams
// the weights. Widening each weight to float costs three vector instructions per 16 weights,
// more than this CPU can issue while the bytes stream in; integer dot products
// (vpdpbusd: 64 multiply-adds of unsigned bytes by signed bytes into int32) cost one per 64
// weights, so the kernel multiplies integers and scales once per block of inputs.
//
// x is written exactly enough in integers: per row and block of inputs (the int4 group, or
// 128 inputs for int8), x ~ xs * xi with xi = round(x / xs) a 16-bit integer
// (|xi| <= 32512, xs = max |x| / 32512, an error under 2^-16 of the block's largest |x|:
// finer than bf16's own rounding of that element), split into signed bytes xi = 256 hi + lo.
// Weights are unsigned bytes u (int8: u = q + 128; int4: the code, 0..15), so
//   sum_k u xi = 256 sum_k u hi + sum_k u lo
// is an exact int32 per block, and the block adds to the float sum:
//   int8 (w = scale[n] q):                 xs (sum u xi - 128 sum xi), times scale[n] at the end
//   int4 (w = (u - 8) s + z, per group):   xs (s (sum u xi - 8 sum xi) + z sum xi)
//
// Layout, made at load by travelator/model/quant.py: output rows in tiles of 64 (4 blocks of
// 16, one per vector lane), a lane's 32 bits holding consecutive inputs of its row, so each
// block of inputs streams front to back:
//   int8 [N/64][K/4][4][16 lanes][4 bytes]: the bytes of inputs k..k+3
//   int4 [N/64][K/8][4][16 lanes][4 bytes]: byte j holds input k+j in its low nibble and
//        k+4+j in its high one
// A row's sums run over k in the same order whatever M is and however the rows are split
// over threads, so a row's result does not depend on the other rows of x.
//
// Built where the compiler targets AVX512-VNNI and AVX512-BW, or AVX2 (the same sums from
// vpmaddubsw and vpmaddwd, see there); the Python side dequantizes and calls torch's matmul
// elsewhere. The dequantizing path (many rows of x) is built for AVX512-BW and AVX2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec8.h"

namespace {

#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;
#endif

constexpr int64_t kTileRows = 64;     // output rows of a tile: 4 vectors of 16 lanes (AVX2: 8 of 8)

// fn((float*)nullptr) or fn((c10::BFloat16*)nullptr), as `dtype` says.
template <typename Fn>
auto with_float_type(at::ScalarType dtype, Fn fn) {
  if (dtype == at::kFloat) return fn(static_cast<float*>(nullptr));
  return fn(static_cast<c10::BFloat16*>(nullptr));
}

void check_packed(const at::Tensor& packed, const char* name) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == 4 && packed.size(3) == kTileRows, name, ": bad packed layout");
}

constexpr int64_t kInt8Block = 128;   // inputs per block of x's integer form (int8 weights)
constexpr int32_t kXMax = 32512;      // 127 * 256: hi stays a signed byte
constexpr float kXMinTop = 1e-30f;    // blocks of x below this are taken as zero

// x in integers: per row, hi and lo bytes [K] and per block its scale and sum of xi.
struct IntegerX {
  std::vector<int8_t> hi, lo;
  std::vector<int16_t> xi16;  // xi itself: the AVX2 int8 tiles' operand
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t K = 0, block = 0, blocks = 0;
};

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
// behind on a tile's stream (1 or 4 KB ahead measured slower here).
inline void prefetch_ahead(const uint8_t* wk) {
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048 + 64 * line, _MM_HINT_T0);
}

// A block's exact sum over its inputs of u xi = 256 (u . hi) + (u . lo), less `offset`.
inline __m512i block_sum(__m512i u_hi, __m512i u_lo, __m512i offset) {
  return _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(u_hi, 8), u_lo), offset);
}

// NT adjacent tiles of 64 output rows (tile j at w + j * tile_bytes, its rows' scales at
// row_scale + 64 j, its sums at out + j * tile_out) against MR rows of x (rows m0..m0+MR-1),
// int8 weights. Two tiles at once for one row of x: two streams in flight, 8-12% faster from
// memory here than one; each tile's sums are the same instructions in the same order.
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

// The same for int4 weights, groups of `group` inputs; sz: [groups][2][64] (scale, zero),
// tile j's at sz + j * tile_sz.
template <int64_t MR, int64_t NT>
void tiles_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t tile_bytes, const float* sz,
                int64_t tile_sz, float* out, int64_t out_stride, int64_t tile_out) {
  const int64_t K = xi.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
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
          const __m512i lo = _mm512_and_si512(wv, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nibble);
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
        const float* s = sz + j * tile_sz + g * 2 * kTileRows;
        const float* z = s + kTileRows;
        for (int r = 0; r < 4; ++r) {
          const __m512i a = block_sum(ah[j][m][r], al[j][m][r], offset);
          const __m512 sxs = _mm512_mul_ps(_mm512_loadu_ps(s + r * 16), xs);
          tot[j][m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sxs, tot[j][m][r]);
          tot[j][m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(z + r * 16), zx, tot[j][m][r]);
        }
      }
    }
  }
  for (int64_t j = 0; j < NT; ++j)
    for (int64_t m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + j * tile_out + m * out_stride + r * 16, tot[j][m][r]);
}

#elif defined(TRAVELATOR_VEC8)
// AVX2 has no vpdpbusd; the same exact integer sums come from other instructions:
//   int8: u widened to 16 bits and xi as it is (16-bit), vpmaddwd: pairs of products into
//         int32, at most 2 * 255 * 32512 each, so a block of 128 inputs stays below 2^31;
//   int4: vpmaddubsw (unsigned bytes times signed bytes, pairs into int16, saturating) on
//         the codes and x's hi and lo bytes: a code is at most 15, so a pair is at most
//         2 * 15 * 128 and nothing saturates; vpmaddwd by 256 or by 1 then widens the hi and
//         lo sums, so one int32 vector holds a group's 256 (u . hi) + (u . lo).
// The integer sums are the AVX-512 kernel's and so are the float steps, lane for lane, so a
// row comes out of both with the same bits.
#define TRAVELATOR_QUANT_KERNEL 1
constexpr int64_t kRowsPerTile = 4;  // rows of x a tile is read for at once
constexpr bool kPairTiles = false;   // a tile at a time, whatever M
constexpr int kVectors = 8;          // vectors of 8 output rows in a tile

template <typename scalar_t>
inline __m256 load8(const scalar_t* p, int64_t n) {
  if (n >= 8) return v8::load(p);
  alignas(32) float part[8] = {};
  for (int64_t i = 0; i < n; ++i) part[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(part);
}

inline float max8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

template <typename scalar_t>
IntegerX integer_x(const scalar_t* x, int64_t M, int64_t K, int64_t K_padded, int64_t block) {
  IntegerX r;
  r.K = K_padded, r.block = block, r.blocks = K_padded / block;
  r.hi.assign(M * K_padded, 0), r.lo.assign(M * K_padded, 0);
  r.xi16.assign(M * K_padded, 0);
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
      const float top = max8(mx);
      if (std::isinf(top)) {  // as in the AVX-512 kernel
        r.scale[m * r.blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (!(top > kXMinTop)) continue;  // as in the AVX-512 kernel: xi = 0
      const __m256 inv = _mm256_set1_ps(kXMax / top);
      const __m256i lim = _mm256_set1_epi32(kXMax), neg_lim = _mm256_set1_epi32(-kXMax);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 8) {
        // Round to nearest even (the default rounding mode), then clamp.
        __m256i xi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k, k1 - k), inv));
        xi = _mm256_max_epi32(_mm256_min_epi32(xi, lim), neg_lim);
        sum = _mm256_add_epi32(sum, xi);  // lanes past k1 are 0
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), xi);
        for (int64_t i = 0; i < std::min<int64_t>(8, k1 - k); ++i) {
          const int8_t lo = static_cast<int8_t>(lanes[i] & 0xFF);  // low byte, signed
          const int8_t hi = static_cast<int8_t>((lanes[i] - lo) / 256);
          const int64_t at = m * K_padded + k + i;
          r.lo[at] = lo, r.hi[at] = hi;
          r.xi16[at] = static_cast<int16_t>(lanes[i]);
        }
      }
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      r.scale[m * r.blocks + b] = top / kXMax;
      r.sum[m * r.blocks + b] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    }
  }
  return r;
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + 256 (u . hi) + (u . lo) over 8 inputs: u0 the codes of the first 4 (low nibbles), u1
// of the next 4. Two int16 pairs add up to at most 4 * 15 * 128: no saturation.
inline __m256i dot_int4(__m256i acc, __m256i u0, __m256i u1, __m256i hi0, __m256i lo0, __m256i hi1, __m256i lo1) {
  const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(u0, hi0), _mm256_maddubs_epi16(u1, hi1));
  const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(u0, lo0), _mm256_maddubs_epi16(u1, lo1));
  const __m256i h = _mm256_madd_epi16(ph, _mm256_set1_epi16(256)), l = _mm256_madd_epi16(pl, _mm256_set1_epi16(1));
  return _mm256_add_epi32(acc, _mm256_add_epi32(h, l));
}

// The 4 lines of a step 2 KB on (as in the AVX-512 kernel; 4 and 8 KB measured no different).
inline void prefetch_ahead(const uint8_t* wk) {
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048 + 64 * line, _MM_HINT_T0);
}

// One tile of 64 output rows (8 vectors of 8) against MR rows of x, int8 weights. Sixteen
// registers do not hold 8 vectors' sums for several rows, so each block of inputs (8 KB of
// the tile, which stays in L1) is taken in passes of 4 / MR vectors. The running float sums
// live in `out`.
template <int64_t MR>
void tile_int8(const IntegerX& xi, int64_t m0, const uint8_t* w, const float* row_scale, float* out,
               int64_t out_stride) {
  constexpr int RG = 4 / MR;  // vectors per pass
  const int64_t K = xi.K;
  for (int64_t m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + m * out_stride + v * 8, _mm256_setzero_ps());
  for (int64_t b = 0; b < xi.blocks; ++b) {
    const int64_t k0 = b * xi.block;
    for (int v0 = 0; v0 < kVectors; v0 += RG) {
      // Per vector two sums: rows 0-3 and 4-7 of its 8, each row in two lanes (inputs k, k+1
      // and k+2, k+3).
      __m256i acc[MR][RG][2];
      for (int64_t m = 0; m < MR; ++m)
        for (int v = 0; v < RG; ++v) acc[m][v][0] = acc[m][v][1] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + xi.block; k += 4) {
        const uint8_t* wk = w + k * kTileRows;  // 8 vectors of 32 bytes
        if (v0 == 0) prefetch_ahead(wk);
        __m256i xv[MR];  // xi[k..k+3] in every 64 bits
        for (int64_t m = 0; m < MR; ++m) {
          int64_t four;
          std::memcpy(&four, &xi.xi16[(m0 + m) * K + k], 8);
          xv[m] = _mm256_set1_epi64x(four);
        }
        for (int v = 0; v < RG; ++v) {
          const __m128i* d = reinterpret_cast<const __m128i*>(wk + (v0 + v) * 32);
          const __m256i u0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(d)), u1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(d + 1));
          for (int64_t m = 0; m < MR; ++m) {
            acc[m][v][0] = _mm256_add_epi32(acc[m][v][0], _mm256_madd_epi16(u0, xv[m]));
            acc[m][v][1] = _mm256_add_epi32(acc[m][v][1], _mm256_madd_epi16(u1, xv[m]));
          }
        }
      }
      for (int64_t m = 0; m < MR; ++m) {
        const int64_t mb = (m0 + m) * xi.blocks + b;
        const __m256i offset = _mm256_set1_epi32(128 * xi.sum[mb]);
        const __m256 scale = _mm256_set1_ps(xi.scale[mb]);
        for (int v = 0; v < RG; ++v) {
          // Lanes (0 1 4 5 | 2 3 6 7) of the row sums, then in row order: sum u xi - 128 sum xi.
          const __m256i rows = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m][v][0], acc[m][v][1]), 0xD8);
          float* tot = out + m * out_stride + (v0 + v) * 8;
          const __m256 a = _mm256_cvtepi32_ps(_mm256_sub_epi32(rows, offset));
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

// The same for int4 weights, groups of `group` inputs; sz: [groups][2][64] (scale, zero).
template <int64_t MR>
void tile_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, const float* sz, float* out,
               int64_t out_stride) {
  constexpr int RG = 4 / MR;
  const int64_t K = xi.K;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + m * out_stride + v * 8, _mm256_setzero_ps());
  for (int64_t g = 0; g < xi.blocks; ++g) {
    const int64_t k0 = g * xi.block;
    const float* s = sz + g * 2 * kTileRows;
    const float* z = s + kTileRows;
    for (int v0 = 0; v0 < kVectors; v0 += RG) {
      __m256i acc[MR][RG];
      for (int64_t m = 0; m < MR; ++m)
        for (int v = 0; v < RG; ++v) acc[m][v] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + xi.block; k += 8) {
        const uint8_t* wk = w + k / 2 * kTileRows;  // 8 vectors of 32 bytes: 8 inputs of 64 rows
        if (v0 == 0) prefetch_ahead(wk);
        __m256i hi0[MR], lo0[MR], hi1[MR], lo1[MR];
        for (int64_t m = 0; m < MR; ++m) {
          const int64_t at = (m0 + m) * K + k;
          hi0[m] = bcast4(&xi.hi[at]), lo0[m] = bcast4(&xi.lo[at]);
          hi1[m] = bcast4(&xi.hi[at + 4]), lo1[m] = bcast4(&xi.lo[at + 4]);
        }
        for (int v = 0; v < RG; ++v) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + (v0 + v) * 32));
          const __m256i u0 = _mm256_and_si256(d, nibble), u1 = _mm256_and_si256(_mm256_srli_epi16(d, 4), nibble);
          for (int64_t m = 0; m < MR; ++m) acc[m][v] = dot_int4(acc[m][v], u0, u1, hi0[m], lo0[m], hi1[m], lo1[m]);
        }
      }
      for (int64_t m = 0; m < MR; ++m) {
        const int64_t mg = (m0 + m) * xi.blocks + g;
        const __m256i offset = _mm256_set1_epi32(8 * xi.sum[mg]);
        const __m256 xs = _mm256_set1_ps(xi.scale[mg]);
        const __m256 zx = _mm256_set1_ps(xi.scale[mg] * static_cast<float>(xi.sum[mg]));
        for (int v = 0; v < RG; ++v) {
          const int r = (v0 + v) * 8;
          float* tot = out + m * out_stride + r;
          const __m256 sxs = _mm256_mul_ps(_mm256_loadu_ps(s + r), xs);
          __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][v], offset)), sxs, _mm256_loadu_ps(tot));
          _mm256_storeu_ps(tot, _mm256_fmadd_ps(_mm256_loadu_ps(z + r), zx, t));
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

template <int64_t MR, int64_t NT>
void tiles_int4(const IntegerX& xi, int64_t m0, const uint8_t* w, int64_t, const float* sz, int64_t, float* out,
                int64_t out_stride, int64_t) {
  static_assert(NT == 1);
  tile_int4<MR>(xi, m0, w, sz, out, out_stride);
}
#endif

#if defined(TRAVELATOR_QUANT_KERNEL)
// Every tile against every row of x, kRowsPerTile rows at a time (the tile stays in cache
// between), then 2 and 1; for one row of x (kPairTiles), two tiles at a time:
// tile(rows, tiles, t, m, out, stride, tile_out) with rows and tiles std::integral_constants,
// tile t + j's sums at out + j * tile_out.
template <typename scalar_t, typename TileFn>
at::Tensor run_tiles(const at::Tensor& x, int64_t N, int64_t n_tiles, TileFn tile) {
  using one = std::integral_constant<int64_t, 1>;
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto* yp = y.data_ptr<scalar_t>();
  const int64_t tile_out = M * kTileRows;
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out_rows(2 * tile_out);
    float* out = out_rows.data();
    for (int64_t t = begin; t < end;) {
      int64_t tiles = 1;
      if constexpr (kPairTiles) {
        if (M == 1 && t + 1 < end) {
          tile(one{}, std::integral_constant<int64_t, 2>{}, t, 0, out, kTileRows, tile_out);
          tiles = 2;
        }
      }
      if (tiles == 1) {
        int64_t m = 0;
        for (; m + kRowsPerTile <= M; m += kRowsPerTile)
          tile(std::integral_constant<int64_t, kRowsPerTile>{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
        if constexpr (kRowsPerTile > 2) {
          if (m + 2 <= M) {
            tile(std::integral_constant<int64_t, 2>{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
            m += 2;
          }
        }
        if (m < M) tile(one{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
      }
      for (int64_t j = 0; j < tiles; ++j, ++t) {
        const int64_t n0 = t * kTileRows, n1 = std::min(N, n0 + kTileRows);
        const float* sums = out + j * tile_out;
        for (int64_t mm = 0; mm < M; ++mm)
          for (int64_t n = n0; n < n1; ++n) yp[mm * N + n] = static_cast<scalar_t>(sums[mm * kTileRows + n - n0]);
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              name, ": x must be contiguous bf16 or float32 [M, K]");
}

// x [M, K] bf16; packed uint8 [N_padded / 64, K_padded / 4, 4, 64] (K_padded: K rounded up to
// 128); scales float32 [N_padded]. Returns bf16 [M, N].
at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  check_x(x, "quant_linear_int8");
  check_packed(packed, "quant_linear_int8");
  const int64_t n_tiles = packed.size(0), K_padded = packed.size(1) * 4, K = x.size(1);
  TORCH_CHECK(K_padded % kInt8Block == 0 && K <= K_padded && K_padded - K < kInt8Block, "quant_linear_int8: K does not match");
  TORCH_CHECK(N <= n_tiles * kTileRows && N > (n_tiles - 1) * kTileRows, "quant_linear_int8: N does not match");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n_tiles * kTileRows,
              "quant_linear_int8: scales must be float32 [N_padded]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t tile_bytes = K_padded * kTileRows;
  return with_float_type(x.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const IntegerX xi = integer_x(x.data_ptr<scalar_t>(), x.size(0), K, K_padded, kInt8Block);
    return run_tiles<scalar_t>(x, N, n_tiles, [&](auto rows, auto tiles, int64_t t, int64_t m, float* out,
                                                  int64_t stride, int64_t tile_out) {
      tiles_int8<rows(), tiles()>(xi, m, w + t * tile_bytes, tile_bytes, s + t * kTileRows, out, stride, tile_out);
    });
  });
}

// x [M, K] bf16; packed uint8 [N_padded / 64, K / 8, 4, 64]; scales_zeros float32
// [N_padded / 64, K / group, 2, 64]. Returns bf16 [M, N].
at::Tensor quant_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                             int64_t group, int64_t N) {
  check_x(x, "quant_linear_int4");
  check_packed(packed, "quant_linear_int4");
  const int64_t n_tiles = packed.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) * 8 == K && group % 8 == 0 && K % group == 0, "quant_linear_int4: K does not match");
  TORCH_CHECK(N <= n_tiles * kTileRows && N > (n_tiles - 1) * kTileRows, "quant_linear_int4: N does not match");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kFloat && scales_zeros.is_contiguous() &&
              scales_zeros.dim() == 4 && scales_zeros.size(0) == n_tiles && scales_zeros.size(1) == K / group &&
              scales_zeros.size(2) == 2 && scales_zeros.size(3) == kTileRows, "quant_linear_int4: bad scales_zeros");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sz = scales_zeros.data_ptr<float>();
  const int64_t tile_bytes = K / 2 * kTileRows, tile_sz = K / group * 2 * kTileRows;
  return with_float_type(x.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const IntegerX xi = integer_x(x.data_ptr<scalar_t>(), x.size(0), K, K, group);
    return run_tiles<scalar_t>(x, N, n_tiles, [&](auto rows, auto tiles, int64_t t, int64_t m, float* out,
                                                  int64_t stride, int64_t tile_out) {
      tiles_int4<rows(), tiles()>(xi, m, w + t * tile_bytes, tile_bytes, sz + t * tile_sz, tile_sz, out, stride,
                                  tile_out);
    });
  });
}

#endif  // TRAVELATOR_QUANT_KERNEL

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TRAVELATOR_QUANT_DEQUANTIZE 1
// The float weights, transposed: [K, N padded to 64] in `dtype`, for many rows of x, where
// the bf16 GEMM (AMX) on a dequantized copy beats the integer kernel. A vector's 16 lanes
// are 16 output rows, which lie side by side in W^T: every store is a whole vector.
constexpr int64_t kLanes = 16;
inline void store_lanes(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_lanes(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16 does (no NaNs here).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// A vector of kLanes rows at d (a lane's 4 bytes: 4 inputs of q + 128) times the rows'
// scales: put(j, w) for inputs j = 0..3.
template <typename PutFn>
inline void dequantize_int8_lanes(const uint8_t* d, const float* scales, PutFn put) {
  const __m512 scale = _mm512_loadu_ps(scales);
  const __m512i v = _mm512_loadu_si512(d);
  for (int j = 0; j < 4; ++j) {
    const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
    put(j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))), scale));
  }
}

// The same for int4 (a lane's 4 bytes: 8 inputs' codes, see the header); sz: the rows'
// scales, their zeros kTileRows on. put(j, w) for inputs j = 0..7.
template <typename PutFn>
inline void dequantize_int4_lanes(const uint8_t* d, const float* sz, PutFn put) {
  const __m512 scale = _mm512_loadu_ps(sz), zero = _mm512_loadu_ps(sz + kTileRows);
  // (q - 8) * scale + zero = q * scale + (zero - 8 * scale)
  const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
  const __m512i v = _mm512_loadu_si512(d);
  for (int j = 0; j < 8; ++j) {
    const int shift = 8 * (j % 4) + 4 * (j / 4);
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0x0F));
    put(j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, base));
  }
}

#elif defined(TRAVELATOR_VEC8)
#define TRAVELATOR_QUANT_DEQUANTIZE 1
constexpr int64_t kLanes = 8;
template <typename scalar_t>
inline void store_lanes(scalar_t* p, __m256 v) { v8::store(p, v); }

// As above, 8 rows a vector.
template <typename PutFn>
inline void dequantize_int8_lanes(const uint8_t* d, const float* scales, PutFn put) {
  const __m256 scale = _mm256_loadu_ps(scales);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d));
  for (int j = 0; j < 4; ++j) {
    const __m256i u = _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), _mm256_set1_epi32(0xFF));
    put(j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(128))), scale));
  }
}

template <typename PutFn>
inline void dequantize_int4_lanes(const uint8_t* d, const float* sz, PutFn put) {
  const __m256 scale = _mm256_loadu_ps(sz), zero = _mm256_loadu_ps(sz + kTileRows);
  const __m256 base = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d));
  for (int j = 0; j < 8; ++j) {
    const int shift = 8 * (j % 4) + 4 * (j / 4);
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0x0F));
    put(j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, base));
  }
}
#endif

#if defined(TRAVELATOR_QUANT_DEQUANTIZE)
// For every tile t, step of inputs and vector r of kLanes rows (in parallel over tiles), in
// W^T's whole cache lines (a tile's 64 columns) step by step: emit(t, step, r, put), where
// put(i, v) stores v as the kLanes columns of W^T's row step * inputs_per_step + i.
template <typename EmitFn>
void dequantize_tiles(at::Tensor& out, int64_t n_tiles, int64_t steps, int64_t inputs_per_step, const char* name,
                      EmitFn emit) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == steps * inputs_per_step && out.size(1) == n_tiles * kTileRows &&
              out.is_contiguous() && (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              name, ": out must be a contiguous bf16 or float32 [K, N padded to 64]");
  const int64_t Np = n_tiles * kTileRows;
  with_float_type(out.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t step = 0; step < steps; ++step)
          for (int r = 0; r < kTileRows / kLanes; ++r) {
            scalar_t* cols = o + step * inputs_per_step * Np + t * kTileRows + r * kLanes;
            emit(t, step, r, [&](int64_t i, auto v) { store_lanes(cols + i * Np, v); });
          }
    });
  });
}

// out: [K, N padded] (a buffer the caller keeps: a fresh one costs its page faults, as much
// as the work itself here).
void quant_dequantize_int8(const at::Tensor& packed, const at::Tensor& scales, at::Tensor out) {
  check_packed(packed, "quant_dequantize_int8");
  const int64_t n_tiles = packed.size(0), quads = packed.size(1);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  dequantize_tiles(out, n_tiles, quads, 4, "quant_dequantize_int8", [&](int64_t t, int64_t kq, int r, auto put) {
    dequantize_int8_lanes(w + (t * quads + kq) * 4 * kTileRows + r * kLanes * 4, s + t * kTileRows + r * kLanes, put);
  });
}

void quant_dequantize_int4(const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t group, at::Tensor out) {
  check_packed(packed, "quant_dequantize_int4");
  const int64_t n_tiles = packed.size(0), octets = packed.size(1), K = octets * 8, groups = K / group;
  TORCH_CHECK(K % group == 0 && scales_zeros.numel() == n_tiles * groups * 2 * kTileRows, "quant_dequantize_int4: bad shape");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sz = scales_zeros.data_ptr<float>();
  dequantize_tiles(out, n_tiles, octets, 8, "quant_dequantize_int4", [&](int64_t t, int64_t ko, int r, auto put) {
    dequantize_int4_lanes(w + (t * octets + ko) * 4 * kTileRows + r * kLanes * 4,
                          sz + ((t * groups + ko * 8 / group) * 2) * kTileRows + r * kLanes, put);
  });
}

#endif  // TRAVELATOR_QUANT_DEQUANTIZE

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
#if defined(TRAVELATOR_QUANT_KERNEL)
  m.def("quant_linear_int8(Tensor x, Tensor packed, Tensor scales, int N) -> Tensor");
  m.impl("quant_linear_int8", c10::DispatchKey::CPU, &quant_linear_int8);
  m.def("quant_linear_int4(Tensor x, Tensor packed, Tensor scales_zeros, int group, int N) -> Tensor");
  m.impl("quant_linear_int4", c10::DispatchKey::CPU, &quant_linear_int4);
#endif
#if defined(TRAVELATOR_QUANT_DEQUANTIZE)
  m.def("quant_dequantize_int8(Tensor packed, Tensor scales, Tensor(a!) out) -> ()");
  m.impl("quant_dequantize_int8", c10::DispatchKey::CPU, &quant_dequantize_int8);
  m.def("quant_dequantize_int4(Tensor packed, Tensor scales_zeros, int group, Tensor(a!) out) -> ()");
  m.impl("quant_dequantize_int4", c10::DispatchKey::CPU, &quant_dequantize_int4);
#endif
}
