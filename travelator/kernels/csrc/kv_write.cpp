// The new tokens' keys and values into their paged KV cache slots (int8 caches quantized
// per head).

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kv_layout.h"
#include "row_common.h"

namespace {

using namespace travelator::rows;
#if defined(TRAVELATOR_VEC16)
namespace v16 = travelator::vec16;
#endif

// One head's vector as an int8 cache row: codes = round(x * (127 / max|x|)), then the float32
// scale max|x| / 127; a row with a NaN or an infinity gets codes 0 and a NaN scale, a row
// whose 127 / max|x| overflows (all zeros, or below ~4e-37) codes 0. The
// same float steps as model/kv_layout.py's quantize_rows, so both give the same bytes.
template <typename T>
void quantize_kv_row(const T* x, int64_t d, int8_t* out) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (int64_t i = 0; i < d; i += kLanes) {
      const __mmask16 m = v16::lanes(d - i);
      const __m512 v = v16::load(x + i, m);
      // v - v is 0 for a finite v, NaN for an infinity or a NaN.
      not_finite |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    const bool finite = not_finite == 0;
    const float amax = finite ? _mm512_reduce_max_ps(vmax) : 0.0f;
    const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inv_scalar = 127.0f / amax;  // all zeros, or a max below ~4e-37: not finite
    const __m512 inv = _mm512_set1_ps(finite && std::isfinite(inv_scalar) ? inv_scalar : 0.0f);
    for (int64_t i = 0; i < d; i += kLanes) {
      const __mmask16 m = v16::lanes(d - i);
      // Converted with the default rounding, to nearest even: std::nearbyint's.
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v16::load(x + i, m), inv));
      _mm512_mask_cvtepi32_storeu_epi8(out + i, m, finite ? codes : _mm512_setzero_si512());
    }
    std::memcpy(out + d, &scale, sizeof(scale));
    return;
  }
#endif
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float inv_scalar = 127.0f / amax;  // all zeros, or a max below ~4e-37: not finite
  const float inv = finite && std::isfinite(inv_scalar) ? inv_scalar : 0.0f;
  for (int64_t i = 0; i < d; ++i)
    out[i] = finite ? static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inv)) : 0;
  std::memcpy(out + d, &scale, sizeof(scale));
}

// The new tokens' keys and values into their cache slots: k, v [T, KVH, D] (row-strided
// views of the fused QKV tensor are fine), caches [blocks, KVH, block_size, row], slots [T]
// long (slot = block * block_size + position). A cache of k's dtype takes one copy per
// token and head (index_copy_ takes two passes and a per-element index check); an int8
// cache (row = D + 4) takes each head quantized.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  TORCH_CHECK(heads_contiguous(k) && heads_contiguous(v) && k.sizes() == v.sizes(), "write_kv_: k, v must be [T, KVH, D] with contiguous heads");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "write_kv_: k and v dtypes differ");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t heads = k.size(1), d = k.size(2), row = int8 ? d + 4 : d;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(1) == heads && k_cache.size(3) == row, "write_kv_: caches must be [blocks, KVH, block_size, row] for k");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (int8 || k_cache.scalar_type() == k.scalar_type()),
              "write_kv_: caches and k, v must share a dtype (or the caches be int8)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "write_kv_: bad slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(2), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_: slot ", slot[t], " out of range");
  // Row index of (slot, head) in the cache.
  auto row_of = [&](int64_t s, int64_t h) { return travelator::kv_row(s / block_size, h, s % block_size, heads, block_size); };
  if (int8) {
    int8_t* kc = k_cache.data_ptr<int8_t>();
    int8_t* vc = v_cache.data_ptr<int8_t>();
    dispatch_float_types(k, "write_kv_", [&](auto tag) {
      using T = decltype(tag);
      const T* ks = k.data_ptr<T>();
      const T* vs = v.data_ptr<T>();
      at::parallel_for(0, slots.numel(), 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            quantize_kv_row(ks + t * k.stride(0) + h * d, d, kc + row_of(slot[t], h) * row);
            quantize_kv_row(vs + t * v.stride(0) + h * d, d, vc + row_of(slot[t], h) * row);
          }
      });
    });
    return;
  }
  const int64_t row_bytes = d * static_cast<int64_t>(k.element_size());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, slots.numel(), 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kc + row_of(slot[t], h) * row_bytes, ks + t * k_stride + h * row_bytes, row_bytes);
        std::memcpy(vc + row_of(slot[t], h) * row_bytes, vs + t * v_stride + h * row_bytes, row_bytes);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.impl("write_kv_", c10::DispatchKey::CPU, &write_kv_);
}
