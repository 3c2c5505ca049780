// Rotary embeddings applied in place to the query and key heads.

#include <torch/library.h>

#include "row_common.h"

namespace {

using namespace travelator::rows;
#if defined(TRAVELATOR_VEC16)
namespace v16 = travelator::vec16;
#endif

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, int64_t half,
               const int64_t* positions, const float* cos, const float* sin) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + t * row_stride + h * head_dim;
        T* b = a + half;
#if defined(TRAVELATOR_VEC16)
        if constexpr (kVectorised<T>) {
          for (int64_t i = 0; i < half; i += kLanes) {
            const __mmask16 m = v16::lanes(half - i);
            const __m512 x1 = v16::load(a + i, m), x2 = v16::load(b + i, m);
            const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
            v16::store(a + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), m);
            v16::store(b + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), m);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(b[i]);
          a[i] = round_to<T>(x1 * c[i] - x2 * s[i]);
          b[i] = round_to<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

// Rotates the two halves of the first R numbers of every head of q [T, H, D] and k [T, KVH, D]
// in place, by the angles of each token's position (cos, sin: [max_positions, R/2] float32;
// R < D: partial rotary, the rest of a head passes through). q and k may be row-strided views
// of one fused QKV tensor.
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  TORCH_CHECK(heads_contiguous(q) && heads_contiguous(k), "rope_: q, k must be [T, H, D] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.size(2) == k.size(2) && q.size(0) == k.size(0), "rope_: q and k do not match");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0), "rope_: bad positions");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              sin.sizes() == cos.sizes() && cos.size(1) * 2 <= q.size(2), "rope_: bad cos/sin tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_: position ", pos[t], " out of range");
  dispatch_float_types(q, "rope_", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = q.size(2), half = cos.size(1);
    rope_rows(q.data_ptr<T>(), q.size(0), q.stride(0), q.size(1), d, half, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
    rope_rows(k.data_ptr<T>(), k.size(0), k.stride(0), k.size(1), d, half, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, &rope_);
}
