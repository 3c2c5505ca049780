// What the per-row kernels share (norm.cpp, activation.cpp, rope.cpp, kv_write.cpp,
// sampling.cpp): rounding to the model dtype, the dtypes with vector forms, the dtype
// dispatch and the shape checks.
//
// Each kernel reproduces the rounding of the pure-torch layers it replaces (compute in float,
// round to the model dtype where torch does), in one pass over memory. Every row is computed
// on its own, in a fixed order, so results never depend on the number of rows in the step.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "vec16.h"
#include "vec8.h"

namespace travelator::rows {

constexpr int kLanes = 16;

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

#if defined(TRAVELATOR_VEC16) || defined(TRAVELATOR_VEC8)
// float32 and bf16 take the kernels' explicit AVX-512 (or AVX2) forms (the compiler does not
// vectorise the scalar loops' bf16 conversions); other types the scalar loops.
template <typename T>
constexpr bool kVectorised = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#endif

inline void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": expected a contiguous [T, H] tensor");
}

template <typename F>
void dispatch_float_types(const at::Tensor& x, const char* what, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", x.scalar_type());
  }
}

inline bool heads_contiguous(const at::Tensor& x) {
  return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

}  // namespace travelator::rows
