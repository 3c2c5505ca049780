// Every decoder layer of one step in one call (travelator/model/layer_stack.py): the kernels
// the Python layers call (model/llama.py), in the same order, on the same tensors, with the
// same arguments, so the result is the same bits; only the trips back to Python between
// them are gone, which weigh most in a step of a few rows of x.
//
// Only for steps whose every linear layer takes a streaming kernel (small_m_linear,
// blocked_linear or panel_linear for bf16 weights, quant_linear_int8/int4 for quantized ones); the Python
// side checks that, and runs the layers itself otherwise. Each linear layer is three entries
// of `linear_tensors` (a, b, bias) and of `linear_ints` (route, group, N), its route one of
// linear_route.h's: the oneDNN routes stream bf16 weight a through small_m_linear (no bias:
// the Python layer takes the GEMM then), the others as that header says.
// A layer's linear layers follow the previous layer's: QKV, output, then for a dense MLP
// gate/up and down, or for a mixture of experts (experts[l] > 0) the router and each expert's
// gate/up and down (model/moe.py: the top_k of the router's float32 softmax, renormalised
// where `renormalize` says, weighted and summed per token in float32); its norms are
// norms[2 l] (input) and norms[2 l + 1] (after attention), and the last norm the model's;
// head_norms is empty, or (Qwen3) per layer the query and the key head norms, 2 l and 2 l + 1.
// windows[l] is layer l's sliding window (0: none), as its attention passes it.

#include <torch/library.h>

#include "streaming_linear.h"

namespace {

using namespace travelator::streaming;

// x [T, hidden]: the embedded tokens, the residual stream after (updated in place). Returns
// the final norm of the residual stream, as LlamaModel.forward does.
T decoder_layers(T& x, const T& positions, const T& cos, const T& sin, const T& slots, const T& query_start,
                 const T& seq_lens, const T& block_tables, at::TensorList norms, at::TensorList head_norms,
                 at::TensorList k_caches,
                 at::TensorList v_caches, const c10::List<std::optional<T>>& linear_tensors,
                 c10::IntArrayRef linear_ints, c10::IntArrayRef windows, c10::IntArrayRef experts, int64_t top_k,
                 bool renormalize, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                 bool tiled) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  int64_t num_linear = 0;
  for (int64_t l = 0; l < layers; ++l) num_linear += experts[l] > 0 ? 3 + 2 * experts[l] : 4;
  TORCH_CHECK(x.dim() == 2 && layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  (head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers) &&
                  static_cast<int64_t>(experts.size()) == layers &&
                  static_cast<int64_t>(linear_tensors.size()) == 3 * num_linear &&
                  static_cast<int64_t>(linear_ints.size()) == 3 * num_linear &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_layers: inconsistent layer lists");
  const Kernels k;
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  T delta;
  int64_t next = 0;  // the layer's first linear layer
  for (int64_t l = 0; l < layers; ++l) {
    const T normed = l == 0 ? k.rms_norm.call(x, norms[0], eps) : k.add_rms_norm.call(x, delta, norms[2 * l], eps);
    const T qkv = linear(k, linear_tensors, linear_ints, next, normed);
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
    const T attn = k.attention.call(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, tiled, windows[l], std::nullopt, true);
    const T o = linear(k, linear_tensors, linear_ints, next + 1, attn.reshape({t, q_size}));
    const T normed2 = k.add_rms_norm.call(x, o, norms[2 * l + 1], eps);
    if (experts[l] > 0) {  // as moe.SparseMoE.forward
      const T probs = at::softmax(linear(k, linear_tensors, linear_ints, next + 2, normed2), -1, at::kFloat);
      auto [weights, chosen] = at::topk(probs, top_k, -1);
      if (renormalize) weights = weights / weights.sum(-1, true);
      const T out = k.moe_experts_op().call(normed2, chosen, linear_tensors, linear_ints, next + 3, experts[l]);
      const T weighted = out.view({t, top_k, normed2.size(1)}) * weights.to(x.scalar_type()).unsqueeze(-1);
      delta = weighted.to(at::kFloat).sum(1).to(x.scalar_type());
      next += 3 + 2 * experts[l];
    } else {
      const T gate_up = linear(k, linear_tensors, linear_ints, next + 2, normed2);
      delta = linear(k, linear_tensors, linear_ints, next + 3, k.silu_and_mul.call(gate_up));
      next += 4;
    }
  }
  return k.add_rms_norm.call(x, delta, norms[2 * layers], eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("decoder_layers(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, Tensor slots, Tensor query_start, "
        "Tensor seq_lens, Tensor block_tables, Tensor[] norms, Tensor[] head_norms, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
        "Tensor?[] linear_tensors, int[] linear_ints, int[] windows, int[] experts, int top_k, bool renormalize, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, bool tiled) -> Tensor");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
}
