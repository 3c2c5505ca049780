// The experts of a mixture-of-experts layer for a step of a few tokens (a decode of one to a
// few requests) in one call: every (token, expert) pair's gate/up projection, SiLU * up, and
// down projection, each projection by the streaming route its weight was given
// (streaming_linear.h: bf16 weights through small_m_linear's tiles or panel_linear, int8/int4
// through the integer kernels). Where every expert streams bf16 weights through small_m_linear's
// tiles, three passes serve all the
// experts the step uses at once (one parallel loop each) instead of two kernel calls per
// expert; otherwise the experts run one by one from here, without the trips to Python
// between them. An expert no token chose is never read.
//
// The numbers are model/moe.py's Python path's, bit for bit: the same kernels over the same
// rows (each expert's tokens in pair order), the same silu_and_mul kernel between them.
//
// Built where small_m_linear is (AVX512-BF16 or AVX2); elsewhere the Python path runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "dynamic_split.h"
#include "small_m_tiles.h"
#include "streaming_linear.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__) || defined(TRAVELATOR_VEC8)
namespace {
namespace sm = travelator::small_m;
using travelator::streaming::Kernels;
using travelator::streaming::linear;

// One expert's share of a pass: its rows of the pass's input, sorted by expert.
struct Group {
  int64_t expert;
  int64_t first;  // its first row in the sorted order
  int64_t rows;
};

// y[first .. first + rows) = x[first .. first + rows) W_e^T for every group, W_e [N, K]:
// tasks of 64 output rows of one expert, all in one parallel loop; a group of more rows than a
// tile takes goes through in slices of them, the task's weight rows still in cache. Each row's
// sums run in the tile's order whatever the slice: a token's numbers never depend on which
// others chose its expert.
void pass(const std::vector<Group>& groups, const std::vector<sm::XRow>& x, const std::vector<at::Tensor>& weights,
          c10::BFloat16* y, int64_t K, int64_t N) {
  const int64_t chunks = (N + sm::kChunk - 1) / sm::kChunk;
  travelator::dynamic_split(static_cast<int64_t>(groups.size()) * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Group& g = groups[task / chunks];
      const auto* w = weights[g.expert].data_ptr<c10::BFloat16>();
      for (int64_t r = g.first; r < g.first + g.rows; r += sm::kMaxRows) {
        const int64_t m = std::min(sm::kMaxRows, g.first + g.rows - r);
        sm::chunk(x.data() + r * K, w, y + r * N, m, K, N, task % chunks);
      }
    }
  });
}

// Each (token, expert) pair's rows of x, grouped by expert in pair order, as moe.py groups them;
// `order` the pairs, expert by expert. A pair of expert -1 (another rank's) is in no group.
std::vector<Group> group_pairs(const at::Tensor& experts, int64_t num_experts, std::vector<int64_t>& order) {
  const auto ids = experts.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t pairs = experts.numel();
  for (int64_t p = 0; p < pairs; ++p) TORCH_CHECK(id[p] >= -1 && id[p] < num_experts, "moe_experts: expert id out of range");
  std::vector<Group> groups;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t p = 0; p < pairs; ++p)
      if (id[p] == e) order.push_back(p);
    const int64_t rows = static_cast<int64_t>(order.size()) - first;
    if (rows) groups.push_back({e, first, rows});
  }
  return groups;
}

// Every expert's projections stream bf16 weights through small_m_linear (the oneDNN routes, no
// bias): then the fused passes serve them. Panel weights (AVX2) take panel_linear at every row
// count, whose sums follow another order, so their experts run one by one.
bool all_small_m(const c10::List<std::optional<at::Tensor>>& tensors, c10::IntArrayRef ints) {
  for (size_t i = 0; i < ints.size() / 3; ++i) {
    const auto route = static_cast<LinearRoute>(ints[3 * i]);
    const bool streams = route == LinearRoute::kOnednnBf16 || route == LinearRoute::kOnednnFloat32;
    if (!streams || tensors.get(3 * i + 2).has_value())
      return false;
  }
  return true;
}

// The fused passes: gate/up of every used expert in one parallel loop, SiLU * up, down likewise.
at::Tensor fused(const at::Tensor& x, const std::vector<Group>& groups, const std::vector<int64_t>& order, int64_t k,
                 const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& w2, const Kernels& kernels) {
  const int64_t P = static_cast<int64_t>(order.size()), H = x.size(1), N1 = w1[0].size(0), I = N1 / 2;
  for (size_t e = 0; e < w1.size(); ++e) {
    TORCH_CHECK(w1[e].scalar_type() == at::kBFloat16 && w1[e].is_contiguous() && w1[e].size(0) == N1 &&
                    w1[e].size(1) == H, "moe_experts: gate/up weights bf16 [2I, H]");
    TORCH_CHECK(w2[e].scalar_type() == at::kBFloat16 && w2[e].is_contiguous() && w2[e].size(0) == H &&
                    w2[e].size(1) == I, "moe_experts: down weights bf16 [H, I]");
  }
  const auto* xp = x.data_ptr<c10::BFloat16>();
  std::vector<sm::XRow> xs(P * H);
  for (int64_t r = 0; r < P; ++r) sm::widen(xp + order[r] / k * H, xs.data() + r * H, H);
  at::Tensor gu = at::empty({P, N1}, x.options());
  pass(groups, xs, w1, gu.data_ptr<c10::BFloat16>(), H, N1);
  const at::Tensor act = kernels.silu_and_mul.call(gu);
  std::vector<sm::XRow> as(P * I);
  sm::widen(act.data_ptr<c10::BFloat16>(), as.data(), P * I);
  at::Tensor sorted = at::empty({P, H}, x.options());
  pass(groups, as, w2, sorted.data_ptr<c10::BFloat16>(), I, H);
  return sorted;
}

// x: [T, H]; experts: [T, k] int64, each token's experts (distinct per token; -1: an expert
// another rank holds, under expert parallelism); expert e's gate/up and down projections are
// linear layers 2e and 2e + 1 of linear_tensors and linear_ints (streaming_linear.h's
// encoding). Returns [T * k, H]: row t * k + j holds expert experts[t, j]'s output for token t
// (zeros for -1).
// first_linear, num_experts: the experts are linear layers first_linear .. first_linear +
// 2 num_experts - 1 of the lists (the native layer stack passes its whole model's); -1: all.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const c10::List<std::optional<at::Tensor>>& all_tensors,
                       c10::IntArrayRef all_ints, int64_t first_linear, int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_experts: x [T, H], contiguous");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong,
              "moe_experts: experts int64 [T, k]");
  const int64_t layers = static_cast<int64_t>(all_tensors.size()) / 3;
  TORCH_CHECK(all_tensors.size() % 3 == 0 && all_ints.size() == all_tensors.size(), "moe_experts: 3 entries per linear layer");
  const int64_t E = num_experts < 0 ? (layers - first_linear) / 2 : num_experts;
  TORCH_CHECK(E > 0 && first_linear >= 0 && first_linear + 2 * E <= layers, "moe_experts: experts outside the lists");
  c10::List<std::optional<at::Tensor>> tensors;
  tensors.reserve(6 * E);
  for (int64_t i = 3 * first_linear; i < 3 * (first_linear + 2 * E); ++i) tensors.push_back(all_tensors.get(i));
  const c10::IntArrayRef ints = all_ints.slice(3 * first_linear, 6 * E);
  const int64_t k = experts.size(1), H = x.size(1);
  const Kernels kernels;
  std::vector<int64_t> order;
  const std::vector<Group> groups = group_pairs(experts, E, order);
  const int64_t P = static_cast<int64_t>(order.size());
  if (P == 0) return at::zeros({experts.numel(), H}, x.options());  // every pair another rank's
  at::Tensor sorted;
  if (x.scalar_type() == at::kBFloat16 && all_small_m(tensors, ints)) {
    std::vector<at::Tensor> w1, w2;
    for (int64_t e = 0; e < E; ++e) {
      w1.push_back(*tensors.get(6 * e));
      w2.push_back(*tensors.get(6 * e + 3));
    }
    sorted = fused(x, groups, order, k, w1, w2, kernels);
  } else {  // expert by expert, each projection by its route
    sorted = at::empty({P, H}, x.options());
    for (const Group& g : groups) {
      const at::Tensor rows = at::empty({g.rows}, experts.options());
      for (int64_t r = 0; r < g.rows; ++r) rows.data_ptr<int64_t>()[r] = order[g.first + r] / k;
      const at::Tensor h = linear(kernels, tensors, ints, 2 * g.expert, x.index_select(0, rows));
      sorted.narrow(0, g.first, g.rows).copy_(linear(kernels, tensors, ints, 2 * g.expert + 1, kernels.silu_and_mul.call(h)));
    }
  }
  const int64_t rows = experts.numel();
  at::Tensor out = P == rows ? at::empty({rows, H}, x.options()) : at::zeros({rows, H}, x.options());
  const at::Tensor where = at::tensor(order, experts.options());
  return out.index_copy_(0, where, sorted);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor?[] linear_tensors, int[] linear_ints, int first_linear=0, "
        "int num_experts=-1) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, &moe_experts);
}
#endif
