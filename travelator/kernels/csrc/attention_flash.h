// Long prefill chunks of paged_attention.cpp on ATen's flash attention for the CPU, whose
// Q.K and P.V are GEMMs on oneDNN's AMX kernels: over long contexts, where its blocking
// amortises the softmax's bookkeeping better than the tiled kernel, and at any length for
// head sizes the tiled kernel does not take. Taken, like the tiled kernel, only where the
// caller lets a row's numbers depend on its chunk (not batch_invariant), with bf16 queries
// and cache, no sliding window and no sinks, and only on CPUs with AMX (elsewhere it has not
// been measured against the kernels here, see docs/design.md).
//
// A request's keys and values are gathered from its blocks into contiguous copies. ATen's
// causal mask aligns the first query with the first key, so a chunk with keys before it (a
// later chunk of a prompt, or a cached prefix) is several calls: the chunk's own keys
// (causal) and the keys before it (no mask), merged by their log-sum-exps.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/log.h>
#include <ATen/ops/maximum.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "kv_layout.h"

namespace travelator::attention {

// Query rows from which a request's chunk takes the flash route: below them the call's fixed
// costs (the gathered copies, one call a request, fewer blocks of work to share between the
// threads) outweigh its faster products. Keys from which it does so for the tiled kernel's
// head sizes: below them the tiled kernel's products on the tiles (attention_tiles_amx.h)
// are faster (docs/benchmarks.md).
constexpr int64_t kFlashMinQueries = 160;
constexpr int64_t kFlashMinKeys = 1536;
// Keys before a chunk taken per call: bounds the gathered copies of a long context.
constexpr int64_t kFlashKeySlice = 8192;

// Whether this build and CPU take the flash route at all: AMX's tiles, which oneDNN's AMX
// kernels need the process granted.
inline bool flash_route_available() { return travelator::amx_tiles_permitted(); }

// Positions [first, first + count) of one request's K or V cache rows: [1, KVH, count, D],
// contiguous (ATen's kernel maps each query head to its KV head itself).
inline at::Tensor gather_rows(const at::Tensor& cache, const int64_t* table, int64_t first, int64_t count) {
  const int64_t kv_heads = cache.size(1), bs = cache.size(2), d = cache.size(3);
  at::Tensor out = at::empty({1, kv_heads, count, d}, cache.options());
  const auto* src = cache.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      c10::BFloat16* row = dst + h * count * d;
      for (int64_t pos = first; pos < first + count;) {
        const int64_t in_block = pos % bs, n = std::min(bs - in_block, first + count - pos);
        std::memcpy(row, src + travelator::kv_row(table[pos / bs], h, in_block, kv_heads, bs) * d,
                    n * d * sizeof(c10::BFloat16));
        row += n * d, pos += n;
      }
    }
  });
  return out;
}

// Request r's chunk: q rows [start, start + n) of q [T, H, D], at positions seq_len - n ..
// seq_len - 1, into the same rows of out. The chunk's own keys are one causal call; the keys
// before it are taken kFlashKeySlice at a time (unmasked), so that the gathered copies stay
// bounded on long contexts. Each call's output is normalised over its own keys and comes
// with the log-sum-exp of its scaled scores; the parts are merged by those.
inline void attend_chunk_flash(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               at::Tensor& out, int64_t start, int64_t n, int64_t seq_len, const int64_t* table,
                               double scale) {
  const int64_t before = seq_len - n;
  const at::Tensor qr = q.narrow(0, start, n).transpose(0, 1).unsqueeze(0).contiguous();  // [1, H, n, D]
  auto attend = [&](int64_t first, int64_t count, bool causal) {
    return at::_scaled_dot_product_flash_attention_for_cpu(qr, gather_rows(k_cache, table, first, count),
                                                           gather_rows(v_cache, table, first, count), 0.0, causal,
                                                           std::nullopt, scale);
  };
  auto [result, lse] = attend(before, n, /*causal=*/true);
  for (int64_t first = 0; first < before; first += kFlashKeySlice) {
    auto [part, part_lse] = attend(first, std::min(kFlashKeySlice, before - first), /*causal=*/false);
    const at::Tensor top = at::maximum(lse, part_lse);
    const at::Tensor w = at::exp(lse - top).unsqueeze(-1), w_part = at::exp(part_lse - top).unsqueeze(-1);
    result = (result.to(at::kFloat) * w + part.to(at::kFloat) * w_part) / (w + w_part);
    lse = top + at::log(w + w_part).squeeze(-1);
  }
  out.narrow(0, start, n).copy_(result.squeeze(0).transpose(0, 1));
}

}  // namespace travelator::attention
