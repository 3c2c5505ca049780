// The float weights of an int8 or int4 layer, dequantized from the integer kernel's packed
// layout (quant_linear.cpp's header), transposed, for the GEMM of a step of many rows.
// Built for AVX512-BW and AVX2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "quant_common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace travelator::quant;

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
// scales, their zeros kTileRows on; codes through the e2m1 levels where E2M1. put(j, w) for
// inputs j = 0..7.
template <bool E2M1, typename PutFn>
inline void dequantize_int4_lanes(const uint8_t* d, const GroupParam<E2M1>* sz, PutFn put) {
  const __m512 scale = travelator::vec16::load(sz), zero = travelator::vec16::load(sz + kTileRows);
  // (q - 8) * scale + zero = q * scale + (zero - 8 * scale)
  const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
  const __m512i v = _mm512_loadu_si512(d);
  for (int j = 0; j < 8; ++j) {
    const int shift = 8 * (j % 4) + 4 * (j / 4);
    __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0x0F));
    if constexpr (E2M1) q = _mm512_permutexvar_epi32(q, _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                                           reinterpret_cast<const __m128i*>(kE2M1Levels))));
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

// The e2m1 levels of 8 codes (0..15) in 32-bit lanes: two 8-entry lookups, the second for codes 8..15.
inline __m256i e2m1_levels(__m256i q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Levels));
  const __m256i low = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(bytes), q);
  const __m256i high = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), q);
  return _mm256_blendv_epi8(low, high, _mm256_cmpgt_epi32(q, _mm256_set1_epi32(7)));
}

template <bool E2M1, typename PutFn>
inline void dequantize_int4_lanes(const uint8_t* d, const GroupParam<E2M1>* sz, PutFn put) {
  const __m256 scale = v8::load(sz), zero = v8::load(sz + kTileRows);
  const __m256 base = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d));
  for (int j = 0; j < 8; ++j) {
    const int shift = 8 * (j % 4) + 4 * (j / 4);
    __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0x0F));
    if constexpr (E2M1) q = e2m1_levels(q);
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

// out: [K, N padded] (a buffer the caller keeps: a fresh one would cost its page faults at
// every call).
void quant_dequantize_int8(const at::Tensor& packed, const at::Tensor& scales, at::Tensor out) {
  check_packed(packed, "quant_dequantize_int8");
  const int64_t n_tiles = packed.size(0), quads = packed.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n_tiles * kTileRows,
              "quant_dequantize_int8: scales must be float32 [N_padded]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  dequantize_tiles(out, n_tiles, quads, 4, "quant_dequantize_int8", [&](int64_t t, int64_t kq, int r, auto put) {
    dequantize_int8_lanes(w + (t * quads + kq) * 4 * kTileRows + r * kLanes * 4, s + t * kTileRows + r * kLanes, put);
  });
}

void quant_dequantize_int4(const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t group, at::Tensor out,
                           int64_t codebook) {
  check_packed(packed, "quant_dequantize_int4");
  const bool e2m1 = check_codebook(codebook, "quant_dequantize_int4") == Codebook::kE2M1;
  const int64_t n_tiles = packed.size(0), octets = packed.size(1), K = octets * 8;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "quant_dequantize_int4: bad group");
  const int64_t groups = K / group;
  check_scales_zeros(scales_zeros, e2m1 ? Codebook::kE2M1 : Codebook::kUniform, "quant_dequantize_int4");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.numel() == n_tiles * groups * 2 * kTileRows,
              "quant_dequantize_int4: bad shape");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const void* sz = scales_zeros.data_ptr();
  dequantize_tiles(out, n_tiles, octets, 8, "quant_dequantize_int4", [&](int64_t t, int64_t ko, int r, auto put) {
    const uint8_t* d = w + (t * octets + ko) * 4 * kTileRows + r * kLanes * 4;
    const int64_t rows_sz = ((t * groups + ko * 8 / group) * 2) * kTileRows + r * kLanes;
    if (e2m1)
      dequantize_int4_lanes<true>(d, static_cast<const GroupParam<true>*>(sz) + rows_sz, put);
    else
      dequantize_int4_lanes<false>(d, static_cast<const GroupParam<false>*>(sz) + rows_sz, put);
  });
}

#endif  // TRAVELATOR_QUANT_DEQUANTIZE

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
#if defined(TRAVELATOR_QUANT_DEQUANTIZE)
  m.def("quant_dequantize_int8(Tensor packed, Tensor scales, Tensor(a!) out) -> ()");
  m.impl("quant_dequantize_int8", c10::DispatchKey::CPU, &quant_dequantize_int8);
  m.def("quant_dequantize_int4(Tensor packed, Tensor scales_zeros, int group, Tensor(a!) out, int codebook=0) -> ()");
  m.impl("quant_dequantize_int4", c10::DispatchKey::CPU, &quant_dequantize_int4);
#endif
}
