// y = x W^T for a few rows of x (a decode step of one to a few requests), bf16 weights
// in their natural [N, K] layout. At these sizes the step only streams the weights, and
// the GEMM libraries read them well below the machine's bandwidth (oneDNN's blocked GEMM on
// AVX512-BF16 machines; on AVX2 machines, which have no bf16 GEMM, torch's float32 GEMM over
// widened weights). Reading each weight row front to back, a few rows at a time, with the
// next rows prefetched, runs closer to the bandwidth of a sum (docs/benchmarks.md).
//
// Two builds of the same loop:
// - AVX512-BF16: 32 lanes a step, vdpbf16ps (bf16 pairs into float32 sums); up to 4 rows
//   (past them oneDNN's AMX GEMM makes the step faster).
// - AVX2 + FMA (vec8.h): 8 lanes a step, each bf16 widened to float32 (a shift: exact), then FMA;
//   up to 4 rows (past them float32 GEMM over widened weights wins).
// Every output is summed over K in the same order whatever M is and however N is split
// over threads, so a row's result does not depend on the other rows of x.
//
// Not registered on other CPUs; the Python side then uses the GEMM library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "dynamic_split.h"
#include "small_m_tiles.h"

#include <vector>

#if defined(__AVX512BF16__) || defined(TRAVELATOR_VEC8)
namespace {
namespace sm = travelator::small_m;

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_m_linear: bad shapes");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_m_linear: bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_m_linear: contiguous inputs only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= sm::kMaxRows, "small_m_linear: 1 to ", sm::kMaxRows, " rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  std::vector<sm::XRow> xr(M * K);
  sm::widen(x.data_ptr<c10::BFloat16>(), xr.data(), M * K);
  travelator::dynamic_split((N + sm::kChunk - 1) / sm::kChunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) sm::chunk(xr.data(), wp, yp, M, K, N, c);
  });
  return y;
}

int64_t small_m_linear_rows() { return sm::kMaxRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("small_m_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
  // The most rows of x this build takes.
  m.def("small_m_linear_rows() -> int", &small_m_linear_rows);
}
#endif
