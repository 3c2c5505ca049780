// RMSNorm, optionally adding the residual first, and per head (Qwen3's q/k norm), as
// travelator.model.layers.RMSNorm rounds.

#include <torch/library.h>

#include <cmath>

#include "row_common.h"

namespace {

using namespace travelator::rows;
#if defined(TRAVELATOR_VEC16)
namespace v16 = travelator::vec16;
#endif

// Sum of squares with kLanes partial sums combined in a fixed tree: vectorisable
// without reassociation, identical for a row whatever the batch.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      part[l] += v * v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    part[l] += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

#if defined(TRAVELATOR_VEC16)
// sum_squares with the kLanes partial sums in one register, combined by the same tree.
template <typename T>
float sum_squares_vec(const T* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512 v = v16::load(x + i, v16::lanes(n - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float part[kLanes];
  _mm512_storeu_ps(part, acc);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}
#endif

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(sum_squares_vec(x, n) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = v16::lanes(n - i);
      const __m512 normed = v16::round_as(T{}, _mm512_mul_ps(v16::load(x + i, m), r));
      v16::store(out + i, _mm512_mul_ps(v16::load(weight + i, m), normed), m);
    }
    return;
  }
#endif
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(round_to<T>(static_cast<float>(x[i]) * r));
    out[i] = round_to<T>(static_cast<float>(weight[i]) * normed);
  }
}

// row += d, rounded to T as torch's add rounds.
template <typename T>
void add_row(T* row, const T* d, int64_t n) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = v16::lanes(n - i);
      v16::store(row + i, _mm512_add_ps(v16::load(row + i, m), v16::load(d + i, m)), m);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) row[i] = round_to<T>(static_cast<float>(row[i]) + static_cast<float>(d[i]));
}

template <typename T>
void rms_norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xp + r * n;
      if (dp) add_row(row, dp + r * n, n);  // the residual stream += delta
      norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

// weight * round(x * rsqrt(mean(x^2) + eps)), as travelator.model.layers.RMSNorm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "rms_norm: bad weight");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor xm = x;
  dispatch_float_types(x, "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(xm, nullptr, weight, out, eps);
  });
  return out;
}

// x += delta (in place, the residual stream), then returns rms_norm(x).
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(delta, "add_rms_norm_");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "add_rms_norm_: bad delta");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "add_rms_norm_: bad weight");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x, "add_rms_norm_", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, &delta, weight, out, eps);
  });
  return out;
}

// In place over every head of x [T, H, D] (rows of D contiguous, any row strides: a view of
// the QKV projection's output): each head's D numbers normalised as rms_norm normalises a row
// (Qwen3's per-head q/k norm).
void head_rms_norm_(at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "head_rms_norm_: expected [T, H, D] with contiguous heads");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(2),
              "head_rms_norm_: bad weight");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  dispatch_float_types(x, "head_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    T* base = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        T* head = base + (i / heads) * token_stride + (i % heads) * head_stride;
        norm_row(head, wp, head, d, static_cast<float>(eps));  // each element read before it is written
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("head_rms_norm_", c10::DispatchKey::CPU, &head_rms_norm_);
}
