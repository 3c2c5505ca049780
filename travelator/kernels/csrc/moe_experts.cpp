// The experts of a mixture-of-experts layer for a step of a few tokens (a decode of one to a
// few requests), bf16 weights in their natural layout: every (token, expert) pair's gate/up
// projection, SiLU * up, and down projection, in three passes over all the experts the step
// uses at once (one parallel loop each) instead of two kernel calls per expert. An expert no
// token chose is never read.
//
// The numbers are model/moe.py's Python path's, bit for bit: the same small_m tiles over the
// same rows (each expert's tokens in pair order), the same silu_and_mul kernel between them.
//
// Built where small_m_linear is (AVX512-BF16 or AVX2); elsewhere the Python path runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "small_m_tiles.h"

#include <vector>

#if defined(__AVX512BF16__) || defined(TRAVELATOR_VEC8)
namespace {
namespace sm = travelator::small_m;

// One expert's share of a pass: its rows of the pass's input, sorted by expert.
struct Group {
  int64_t expert;
  int64_t first;  // its first row in the sorted order
  int64_t rows;
};

// y[first .. first + rows) = x[first .. first + rows) W_e^T for every group, W_e [N, K]:
// tasks of 64 output rows of one expert, all in one parallel loop.
void pass(const std::vector<Group>& groups, const std::vector<sm::XRow>& x, const std::vector<at::Tensor>& weights,
          c10::BFloat16* y, int64_t K, int64_t N) {
  const int64_t chunks = (N + sm::kChunk - 1) / sm::kChunk;
  at::parallel_for(0, static_cast<int64_t>(groups.size()) * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Group& g = groups[task / chunks];
      const auto* w = weights[g.expert].data_ptr<c10::BFloat16>();
      sm::chunk(x.data() + g.first * K, w, y + g.first * N, g.rows, K, N, task % chunks);
    }
  });
}

// x: [T, H] bf16; experts: [T, k] int64, each token's experts (distinct per token). Returns
// [T * k, H]: row t * k + j holds expert experts[t, j]'s output for token t.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, at::TensorList gate_up, at::TensorList down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "moe_experts: x bf16 [T, H]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong,
              "moe_experts: experts int64 [T, k]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= sm::kMaxRows, "moe_experts: 1 to ", sm::kMaxRows, " tokens");
  TORCH_CHECK(gate_up.size() == down.size() && !gate_up.empty(), "moe_experts: a gate/up and a down weight per expert");
  const int64_t T = x.size(0), k = experts.size(1), H = x.size(1), E = gate_up.size();
  const int64_t N1 = gate_up[0].size(0), I = N1 / 2;
  std::vector<at::Tensor> w1(gate_up.begin(), gate_up.end()), w2(down.begin(), down.end());
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(w1[e].scalar_type() == at::kBFloat16 && w1[e].is_contiguous() && w1[e].size(0) == N1 &&
                    w1[e].size(1) == H, "moe_experts: gate/up weights bf16 [2I, H]");
    TORCH_CHECK(w2[e].scalar_type() == at::kBFloat16 && w2[e].is_contiguous() && w2[e].size(0) == H &&
                    w2[e].size(1) == I, "moe_experts: down weights bf16 [H, I]");
  }
  // The pairs sorted by expert (stably: each expert's tokens in pair order), as moe.py sorts them.
  const auto ids = experts.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> order;
  std::vector<Group> groups;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t p = 0; p < T * k; ++p) {
      TORCH_CHECK(id[p] >= 0 && id[p] < E, "moe_experts: expert id out of range");
      if (id[p] == e) order.push_back(p);
    }
    const int64_t rows = static_cast<int64_t>(order.size()) - first;
    TORCH_CHECK(rows <= sm::kMaxRows, "moe_experts: a token chose one expert twice");
    if (rows) groups.push_back({e, first, rows});
  }
  const int64_t P = T * k;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  std::vector<sm::XRow> xs(P * H);
  for (int64_t r = 0; r < P; ++r) sm::widen(xp + order[r] / k * H, xs.data() + r * H, H);
  at::Tensor gu = at::empty({P, N1}, x.options());
  pass(groups, xs, w1, gu.data_ptr<c10::BFloat16>(), H, N1);
  static const auto silu_and_mul = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("travelator::silu_and_mul", "")
                                       .typed<at::Tensor(const at::Tensor&)>();
  const at::Tensor act = silu_and_mul.call(gu);
  std::vector<sm::XRow> as(P * I);
  sm::widen(act.data_ptr<c10::BFloat16>(), as.data(), P * I);
  at::Tensor sorted = at::empty({P, H}, x.options());
  pass(groups, as, w2, sorted.data_ptr<c10::BFloat16>(), I, H);
  at::Tensor out = at::empty({P, H}, x.options());
  const auto* sp = sorted.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  for (int64_t r = 0; r < P; ++r) std::copy(sp + r * H, sp + (r + 1) * H, op + order[r] * H);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor[] gate_up, Tensor[] down) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, &moe_experts);
}
#endif
