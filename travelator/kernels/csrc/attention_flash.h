// Long prefill chunks of paged_attention.cpp on ATen's flash attention for the CPU, whose
// Q.K and P.V are GEMMs on oneDNN's AMX kernels: on long chunks it is several times faster
// than the vector kernels here (docs/benchmarks.md). Taken, like the tiled kernel, only where
// the caller lets a row's numbers depend on its chunk (not batch_invariant), with bf16
// queries and cache, no sliding window and no sinks, and only on CPUs with AMX (the one
// kind where it was measured against the kernels here).
//
// A request's keys are gathered from its blocks into one [1, heads, keys, head_dim] copy,
// each KV head's rows repeated for its query heads. ATen's causal mask aligns the first
// query with the first key, so a chunk with keys before it (a later chunk of a prompt, or a
// cached prefix) is two calls, one over the keys before the chunk (no mask) and one over the
// chunk's own (causal), merged by their log-sum-exps.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/maximum.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kv_layout.h"

namespace travelator::attention {

// Query rows from which a request's chunk takes the flash route (below it the kernels here
// are as fast: ATen's has fewer blocks of work to spread over the threads).
constexpr int64_t kFlashMinQueries = 160;

// Whether this build and CPU take the flash route at all: AMX's tiles, and the process
// granted their state by the OS (oneDNN's AMX kernels need it).
inline bool flash_route_available() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  static const bool granted = at::cpu::init_amx();
  return granted;
#else
  return false;
#endif
}

// Positions [first, first + count) of one request's K or V cache rows, every KV head's rows
// repeated for its `group` query heads: [1, KVH * group, count, D], contiguous.
inline at::Tensor gather_rows(const at::Tensor& cache, const int64_t* table, int64_t first, int64_t count,
                              int64_t group) {
  const int64_t kv_heads = cache.size(1), bs = cache.size(2), d = cache.size(3);
  at::Tensor out = at::empty({1, kv_heads * group, count, d}, cache.options());
  const auto* src = cache.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, kv_heads * group, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      c10::BFloat16* row = dst + h * count * d;
      for (int64_t pos = first; pos < first + count;) {
        const int64_t in_block = pos % bs, n = std::min(bs - in_block, first + count - pos);
        std::memcpy(row, src + travelator::kv_row(table[pos / bs], h / group, in_block, kv_heads, bs) * d,
                    n * d * sizeof(c10::BFloat16));
        row += n * d, pos += n;
      }
    }
  });
  return out;
}

// Request r's chunk: q rows [start, start + n) of q [T, H, D], at positions seq_len - n ..
// seq_len - 1, into the same rows of out.
inline void attend_chunk_flash(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               at::Tensor& out, int64_t start, int64_t n, int64_t seq_len, const int64_t* table,
                               double scale) {
  const int64_t group = q.size(1) / k_cache.size(1), before = seq_len - n;
  const at::Tensor qr = q.narrow(0, start, n).transpose(0, 1).unsqueeze(0).contiguous();  // [1, H, n, D]
  auto own = at::_scaled_dot_product_flash_attention_for_cpu(
      qr, gather_rows(k_cache, table, before, n, group), gather_rows(v_cache, table, before, n, group), 0.0,
      /*is_causal=*/true, std::nullopt, scale);
  at::Tensor result = std::get<0>(own);
  if (before > 0) {
    auto earlier = at::_scaled_dot_product_flash_attention_for_cpu(
        qr, gather_rows(k_cache, table, 0, before, group), gather_rows(v_cache, table, 0, before, group), 0.0,
        /*is_causal=*/false, std::nullopt, scale);
    // Each part is normalised over its own keys; lse is log sum exp of its scaled scores.
    const at::Tensor lse_own = std::get<1>(own), lse_earlier = std::get<1>(earlier);
    const at::Tensor top = at::maximum(lse_own, lse_earlier);
    const at::Tensor w_own = at::exp(lse_own - top).unsqueeze(-1), w_earlier = at::exp(lse_earlier - top).unsqueeze(-1);
    result = (std::get<0>(own).to(at::kFloat) * w_own + std::get<0>(earlier).to(at::kFloat) * w_earlier) /
             (w_own + w_earlier);
  }
  out.narrow(0, start, n).copy_(result.squeeze(0).transpose(0, 1));
}

}  // namespace travelator::attention
