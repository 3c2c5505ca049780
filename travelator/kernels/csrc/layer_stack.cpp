// Every decoder layer of one step in one call (travelator/model/layer_stack.py): the kernels
// the Python layers call (model/llama.py), in the same order, on the same tensors, with the
// same arguments, so the result is the same bits; only the trips back to Python between
// them are gone, which weigh most in a step of a few rows of x.
//
// Only for steps whose every linear layer takes a streaming kernel (small_m_linear or
// blocked_linear for bf16 weights, quant_linear_int8/int4 for quantized ones); the Python
// side checks that, and runs the layers itself otherwise. Each linear layer is three entries
// of `linear_tensors` (a, b, bias) and of `linear_ints` (route, group, N), its route one of
// linear_route.h's: the oneDNN routes stream bf16 weight a through small_m_linear (no bias:
// the Python layer takes the GEMM then), the others as that header says.
// Layer l's linear layers are 4 l .. 4 l + 3: QKV, output, gate/up, down; its norms are
// norms[2 l] (input) and norms[2 l + 1] (after attention), and the last norm the model's;
// head_norms is empty, or (Qwen3) per layer the query and the key head norms, 2 l and 2 l + 1.
// windows[l] is layer l's sliding window (0: none), as its attention passes it.

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "linear_route.h"

namespace {

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
using Int4 = T(const T&, const T&, const T&, int64_t, int64_t);

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
                      const std::optional<T>&);
  c10::TypedOperatorHandle<Attention> attention = kernel<Attention>("travelator::paged_attention");
  std::optional<c10::TypedOperatorHandle<SmallM>> small_m = kernel_if_built<SmallM>("travelator::small_m_linear");
  std::optional<c10::TypedOperatorHandle<Blocked>> blocked = kernel_if_built<Blocked>("travelator::blocked_linear");
  std::optional<c10::TypedOperatorHandle<Int8>> int8 = kernel_if_built<Int8>("travelator::quant_linear_int8");
  std::optional<c10::TypedOperatorHandle<Int4>> int4 = kernel_if_built<Int4>("travelator::quant_linear_int4");
};

// y = x W^T (+ bias) for linear layer i, as ops.NativeOps.linear computes it.
T linear(const Kernels& k, const c10::List<std::optional<T>>& tensors, c10::IntArrayRef ints, int64_t i, const T& x) {
  const std::optional<T> a = tensors.get(3 * i), b = tensors.get(3 * i + 1), bias = tensors.get(3 * i + 2);
  const auto route = static_cast<LinearRoute>(ints[3 * i]);
  const int64_t group = ints[3 * i + 1], n = ints[3 * i + 2];
  const bool quantized = route == LinearRoute::kInt8 || route == LinearRoute::kInt4;
  TORCH_CHECK(a.has_value() && (!quantized || b.has_value()), "decoder_layers: linear layer ", i, " lacks a tensor");
  T y;
  switch (route) {
    case LinearRoute::kOnednnBf16:
    case LinearRoute::kOnednnFloat32:
      TORCH_CHECK(k.small_m.has_value() && !bias.has_value(), "decoder_layers: no streaming kernel for layer ", i);
      return k.small_m->call(x.contiguous(), *a);
    case LinearRoute::kBlocked:
      TORCH_CHECK(k.blocked.has_value(), "decoder_layers: this build has no blocked_linear");
      return k.blocked->call(x.contiguous(), *a, bias);
    case LinearRoute::kInt8:
      TORCH_CHECK(k.int8.has_value(), "decoder_layers: this build has no int8 kernel");
      y = k.int8->call(x.contiguous(), *a, *b, n);
      break;
    case LinearRoute::kInt4:
      TORCH_CHECK(k.int4.has_value(), "decoder_layers: this build has no int4 kernel");
      y = k.int4->call(x.contiguous(), *a, *b, group, n);
      break;
    default:
      TORCH_CHECK(false, "decoder_layers: unknown route ", ints[3 * i]);
  }
  return bias.has_value() ? y + *bias : y;
}

// x [T, hidden]: the embedded tokens, the residual stream after (updated in place). Returns
// the final norm of the residual stream, as LlamaModel.forward does.
T decoder_layers(T& x, const T& positions, const T& cos, const T& sin, const T& slots, const T& query_start,
                 const T& seq_lens, const T& block_tables, at::TensorList norms, at::TensorList head_norms,
                 at::TensorList k_caches,
                 at::TensorList v_caches, const c10::List<std::optional<T>>& linear_tensors,
                 c10::IntArrayRef linear_ints, c10::IntArrayRef windows, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, double eps, double scale, bool tiled) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  (head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers) &&
                  static_cast<int64_t>(linear_tensors.size()) == 12 * layers &&
                  static_cast<int64_t>(linear_ints.size()) == 12 * layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_layers: inconsistent layer lists");
  const Kernels k;
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  T delta;
  for (int64_t l = 0; l < layers; ++l) {
    const T normed = l == 0 ? k.rms_norm.call(x, norms[0], eps) : k.add_rms_norm.call(x, delta, norms[2 * l], eps);
    const T qkv = linear(k, linear_tensors, linear_ints, 4 * l, normed);
    T q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    T key = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    const T value = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    if (!head_norms.empty()) {  // in place, through the views, as NativeOps.head_rms_norm
      k.head_rms_norm.call(q, head_norms[2 * l], eps);
      k.head_rms_norm.call(key, head_norms[2 * l + 1], eps);
    }
    k.rope.call(q, key, positions, cos, sin);  // in place, through the views
    T k_cache = k_caches[l], v_cache = v_caches[l];
    k.write_kv.call(k_cache, v_cache, slots, key, value);  // written before read, as in attention.py
    const T attn = k.attention.call(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, tiled, windows[l], std::nullopt);
    const T o = linear(k, linear_tensors, linear_ints, 4 * l + 1, attn.reshape({t, q_size}));
    const T normed2 = k.add_rms_norm.call(x, o, norms[2 * l + 1], eps);
    const T gate_up = linear(k, linear_tensors, linear_ints, 4 * l + 2, normed2);
    delta = linear(k, linear_tensors, linear_ints, 4 * l + 3, k.silu_and_mul.call(gate_up));
  }
  return k.add_rms_norm.call(x, delta, norms[2 * layers], eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("decoder_layers(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, Tensor slots, Tensor query_start, "
        "Tensor seq_lens, Tensor block_tables, Tensor[] norms, Tensor[] head_norms, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
        "Tensor?[] linear_tensors, int[] linear_ints, int[] windows, int num_heads, int num_kv_heads, int head_dim, float eps, "
        "float scale, bool tiled) -> Tensor");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
}
