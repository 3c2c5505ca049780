// Sixteen float lanes of AVX-512 for the CPU kernels. With AVX512F: loads of 16 float32,
// bf16, float16 or int8 values widened to float, the vector form of travelator::exp_approx
// and a reciprocal. With BW and VL too (TRAVELATOR_VEC16): loads and
// stores of float32 and bf16 with a lane mask (so a row's tail goes through the same
// instructions as its body), rounding to bf16 to nearest even as c10::BFloat16 rounds (see
// bf16_bits for the edge cases where AVX512-BF16 differs).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace travelator::vec16 {

inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const c10::BFloat16* p) {  // a bf16 is the top half of a float32: exact
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 1 / d to about 2^-28 (an approximate reciprocal and one Newton step): a division is
// several times dearer on this hardware, and a result within a float ulp rounds to the
// same bf16 value but for values on a rounding boundary.
inline __m512 reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

// travelator::exp_approx on 16 lanes: the same clamp, reduction and polynomial (its last
// step adds r + 1 in one rounding where the scalar form adds r, then 1).
inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.98756912e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819994e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657962e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666657e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00000000e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace travelator::vec16
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TRAVELATOR_VEC16 1

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace travelator::vec16 {

// Lanes [0, n) of 16 (all of them for n >= 16).
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The bf16 bits of each lane, rounded to nearest even as c10::BFloat16(float) rounds. With
// AVX512-BF16 one instruction (which flushes float32 denormals, below 1.2e-38, to zero and
// keeps a NaN's sign and payload, where c10 gives 0x7FC0); without it, c10's integer steps.
inline __m256i bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, bf16_bits(v)); }

// v rounded to T and widened back (what static_cast<float>(T(x)) gives per lane).
inline __m512 round_as(float, __m512 v) { return v; }
inline __m512 round_as(c10::BFloat16, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}

}  // namespace travelator::vec16
#endif
