// 8-lane float helpers for AVX2 + FMA + F16C CPUs without AVX-512 (vec16.h's counterpart): loads
// that widen bf16, float16 and int8 to float, bf16 rounding as c10 rounds, 16 bf16 values at
// a time as their even and odd ones (element-wise work), and travelator::exp_approx on 8 lanes.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define TRAVELATOR_VEC8 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace travelator::vec8 {

inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load(const c10::BFloat16* p) {  // a bf16 is the top half of a float32: exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The sum of the 8 lanes, in a fixed order.
inline float sum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// The largest of the 8 lanes (NaN lanes as _mm_max_ps takes them).
inline float max(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// Each lane rounded to bf16 to nearest even, as c10::BFloat16(float) rounds (a NaN becomes
// 0x7FC0), in the lane's high 16 bits; the low 16 bits are what the rounding left there.
inline __m256i bf16_in_high_half(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline __m256i high_halves() { return _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)); }

// The bf16 bits of each lane, rounded as bf16_in_high_half.
inline __m128i bf16_bits(__m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_in_high_half(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 16 bf16 values as floats without reordering them across lanes: the even-indexed ones in
// `even` (lane i holds value 2i) and the odd-indexed ones in `odd`: a shift and a mask, no
// lane-crossing shuffle; store_even_odd puts them back in order. For element-wise work.
inline void load_even_odd(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high_halves()));
}

inline void store_even_odd(c10::BFloat16* p, __m256 even, __m256 odd) {
  const __m256i lo = _mm256_srli_epi32(bf16_in_high_half(even), 16);
  const __m256i hi = _mm256_and_si256(bf16_in_high_half(odd), high_halves());
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(lo, hi));
}

inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(v)); }

// v rounded to T and widened back (what static_cast<float>(T(x)) gives per lane).
inline __m256 round_as(float, __m256 v) { return v; }
inline __m256 round_as(c10::BFloat16, __m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_in_high_half(v), high_halves()));
}

// travelator::exp_approx on 8 lanes: the same clamp, reduction and polynomial (its last
// step adds r + 1 in one rounding, as vec16::exp).
inline __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.98756912e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.39819994e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33345205e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16657962e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666657e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.00000000e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n as float bits: n is in [-126, 127] after the clamp, a normal number.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace travelator::vec8
#endif
