// The engine's kernels as C++ calls them (layer_stack.cpp, moe_experts.cpp): looked up once per
// call (a hash lookup each) and called without the Python argument parsing of a torch.ops call,
// and a linear layer by its route, as ops.NativeOps.linear computes it.
//
// A linear layer i is three entries of `tensors` (a, b, bias) and of `ints` (route, group, N),
// its route one of linear_route.h's: the oneDNN routes stream bf16 weight a through
// small_m_linear (no bias: the Python layer takes the GEMM then), the blocked and panel routes
// pass their layout's copy as a, the others as that header says.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "linear_route.h"

namespace travelator::streaming {

using T = at::Tensor;

template <typename Sig>
c10::TypedOperatorHandle<Sig> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// A kernel this build may lack (small_m_linear, the quantized ones: by instruction set).
template <typename Sig>
std::optional<c10::TypedOperatorHandle<Sig>> kernel_if_built(const char* name) {
  const auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, ""));
  if (!op.has_value()) return std::nullopt;
  return op->typed<Sig>();
}

using SmallM = T(const T&, const T&);
using Blocked = T(const T&, const T&, const std::optional<T>&);
using Int8 = T(const T&, const T&, const T&, int64_t);
using Int4 = T(const T&, const T&, const T&, int64_t, int64_t, int64_t);

// The engine's kernels, looked up once per call (a hash lookup each) and called without the
// Python argument parsing of a torch.ops call.
struct Kernels {
  c10::TypedOperatorHandle<T(const T&, const T&, double)> rms_norm = kernel<T(const T&, const T&, double)>("travelator::rms_norm");
  c10::TypedOperatorHandle<T(T&, const T&, const T&, double)> add_rms_norm =
      kernel<T(T&, const T&, const T&, double)>("travelator::add_rms_norm_");
  c10::TypedOperatorHandle<void(T&, const T&, double)> head_rms_norm =
      kernel<void(T&, const T&, double)>("travelator::head_rms_norm_");
  c10::TypedOperatorHandle<T(const T&)> silu_and_mul = kernel<T(const T&)>("travelator::silu_and_mul");
  c10::TypedOperatorHandle<void(T&, T&, const T&, const T&, const T&)> rope =
      kernel<void(T&, T&, const T&, const T&, const T&)>("travelator::rope_");
  c10::TypedOperatorHandle<void(T&, T&, const T&, const T&, const T&)> write_kv =
      kernel<void(T&, T&, const T&, const T&, const T&)>("travelator::write_kv_");
  using Attention = T(const T&, const T&, const T&, const T&, const T&, const T&, double, bool, int64_t,
                      const std::optional<T>&, bool);
  c10::TypedOperatorHandle<Attention> attention = kernel<Attention>("travelator::paged_attention");
  std::optional<c10::TypedOperatorHandle<SmallM>> small_m = kernel_if_built<SmallM>("travelator::small_m_linear");
  std::optional<c10::TypedOperatorHandle<Blocked>> blocked = kernel_if_built<Blocked>("travelator::blocked_linear");
  std::optional<c10::TypedOperatorHandle<Blocked>> panels = kernel_if_built<Blocked>("travelator::panel_linear");
  std::optional<c10::TypedOperatorHandle<Int8>> int8 = kernel_if_built<Int8>("travelator::quant_linear_int8");
  std::optional<c10::TypedOperatorHandle<Int4>> int4 = kernel_if_built<Int4>("travelator::quant_linear_int4");
  // Built where small_m_linear is; looked up when a mixture needs it (moe_experts.cpp uses Kernels too).
  using MoE = T(const T&, const T&, const c10::List<std::optional<T>>&, c10::IntArrayRef, int64_t, int64_t);
  c10::TypedOperatorHandle<MoE> moe_experts_op() const { return kernel<MoE>("travelator::moe_experts"); }
};

// y = x W^T (+ bias) for linear layer i, as ops.NativeOps.linear computes it.
inline T linear(const Kernels& k, const c10::List<std::optional<T>>& tensors, c10::IntArrayRef ints, int64_t i, const T& x) {
  const std::optional<T> a = tensors.get(3 * i), b = tensors.get(3 * i + 1), bias = tensors.get(3 * i + 2);
  const auto route = static_cast<LinearRoute>(ints[3 * i]);
  const int64_t group = ints[3 * i + 1], n = ints[3 * i + 2];
  const bool quantized = route == LinearRoute::kInt8 || route == LinearRoute::kInt4 || route == LinearRoute::kInt4Fp4;
  TORCH_CHECK(a.has_value() && (!quantized || b.has_value()), "linear layer ", i, " lacks a tensor");
  T y;
  switch (route) {
    case LinearRoute::kOnednnBf16:
    case LinearRoute::kOnednnFloat32:
      TORCH_CHECK(k.small_m.has_value() && !bias.has_value(), "no streaming kernel for linear layer ", i);
      return k.small_m->call(x.contiguous(), *a);
    case LinearRoute::kPanels:
      TORCH_CHECK(k.panels.has_value(), "this build has no panel_linear");
      return k.panels->call(x.contiguous(), *a, bias);
    case LinearRoute::kBlocked:
      TORCH_CHECK(k.blocked.has_value(), "this build has no blocked_linear");
      return k.blocked->call(x.contiguous(), *a, bias);
    case LinearRoute::kInt8:
      TORCH_CHECK(k.int8.has_value(), "this build has no int8 kernel");
      y = k.int8->call(x.contiguous(), *a, *b, n);
      break;
    case LinearRoute::kInt4:
    case LinearRoute::kInt4Fp4:
      TORCH_CHECK(k.int4.has_value(), "this build has no int4 kernel");
      y = k.int4->call(x.contiguous(), *a, *b, group, n, route == LinearRoute::kInt4Fp4);
      break;
    default:
      TORCH_CHECK(false, "unknown linear route ", ints[3 * i]);
  }
  return bias.has_value() ? y + *bias : y;
}

}  // namespace travelator::streaming
