// Attention over the paged KV cache for one flat batch of any mix of decodes and
// prefill chunks: one call per layer, keys and values read in place through each
// request's block table (no gather into padded copies). Outside batch-invariant mode
// (`tiled`), prefill tiles take the tiled kernel (attention_tiled_bf16.h; its products on
// AMX's tiles where there are), and long prefill chunks over long contexts on AMX CPUs
// ATen's flash attention instead, on a gathered copy of their keys (attention_flash.h).
//
// Batch invariance by construction: every (query, head) row is reduced on its own,
// over the keys in order of position, in chunks of a fixed number of positions (so the same
// for a decode, a prefill chunk or a whole prompt, at any block size), with the same code whatever else is
// in the call. Work is split over threads by (request, query tile, and a range of KV heads
// when there are fewer items than threads), never inside a row, so the thread count and the
// batch change nothing in a row's result.
//
// Per chunk of keys (a fixed count of absolute positions, never the cache's blocks): K is
// gathered through the block table into a float [D][keys] tile, so a row's scores are
// accumulated over d in a fixed order (vectorised across keys, no horizontal sums); then an
// online-softmax update (running max m, sum l, accumulator acc[D]).
//
// A sliding window (window > 0: Mistral, Gemma 3's local layers) limits a query at position
// p to keys p - window + 1 .. p (transformers' convention: key k is seen when
// k > p - window). A work item starts at the chunk holding the first key its first query
// sees, so the chunks stay aligned to absolute positions, and every row masks the keys of a
// chunk before its own first one. Keys before the item's first visible key are never read:
// their blocks may already be back in the pool.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_common.h"
#include "attention_flash.h"
#include "attention_portable.h"
#include "attention_tiled_bf16.h"

namespace {

using namespace travelator::attention;

template <typename scalar_t, typename cache_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         at::Tensor& out, const at::Tensor& query_start, const at::Tensor& seq_lens,
         const at::Tensor& block_tables, double scale, bool tiled, int64_t window, const float* sinks,
         bool amx_tiles) {
  const int64_t num_requests = seq_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // The tiled kernel's products on AMX's tiles, where the tiled kernel takes this head size.
  const bool on_tiles = amx_tiles && travelator::amx_tiles_permitted();
  const bool tiled_head = head_dim == 32 || head_dim == 64 || head_dim == 128;
  (void)on_tiles, (void)tiled_head;  // unused where neither route is built
  // Long prefill chunks go to ATen's flash attention (attention_flash.h), after the rest: those
  // over long contexts, or any where the tiled kernel does not take the head size.
  std::vector<bool> flash(num_requests, false);
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (tiled && on_tiles && window == 0 && sinks == nullptr)
      for (int64_t r = 0; r < num_requests; ++r)
        flash[r] = qs[r + 1] - qs[r] >= kFlashMinQueries && (!tiled_head || lens[r] >= kFlashMinKeys);
  }
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t n = flash[r] ? 0 : qs[r + 1] - qs[r];
    for (int64_t t = 0; t < n; t += kQueryTile) items.push_back({r, t, std::min(kQueryTile, n - t), 0, num_kv_heads});
  }
  // Fewer items than threads (one or two requests decoding): split each over its KV heads,
  // so that every thread has work. A row is still computed whole, by the same code.
  const int64_t threads = at::get_num_threads();
  if (!items.empty() && static_cast<int64_t>(items.size()) < threads && num_kv_heads > 1) {
    const int64_t parts = std::min(num_kv_heads, (threads + static_cast<int64_t>(items.size()) - 1) /
                                                     static_cast<int64_t>(items.size()));
    std::vector<WorkItem> split;
    for (const WorkItem& w : items)
      for (int64_t p = 0; p < parts; ++p)
        split.push_back({w.request, w.first_query, w.num_queries, num_kv_heads * p / parts,
                         num_kv_heads * (p + 1) / parts});
    items.swap(split);
  }
  // Longest items first, handed out one at a time: causal tiles differ a lot in cost (the
  // keys of an item's first query, at most the window, times its queries).
  auto cost = [&](const WorkItem& w) {
    const int64_t pos = lens[w.request] - (qs[w.request + 1] - qs[w.request]) + w.first_query;
    return (pos + 1 - first_key(pos, window)) * w.num_queries;
  };
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
  // Without `tiled`, one kernel for every row of the call: the choice depends on the shapes
  // only. With it, items of many rows take the tiled kernel (and long chunks, above, ATen's).
  (void)tiled;  // unused where the tiled kernel is not built
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  // The pointers are taken here, not in the parallel body: nothing in it can throw (data_ptr
  // checks the dtype), see docs/design.md on TORCH_CHECK and OpenMP regions.
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        auto* item_fn = &attend_item<scalar_t, cache_t>;
#if defined(__AVX512F__)
        if (head_dim == 32) item_fn = &attend_item_vec<scalar_t, cache_t, 2>;
        if (head_dim == 64) item_fn = &attend_item_vec<scalar_t, cache_t, 4>;
        if (head_dim == 128) item_fn = &attend_item_vec<scalar_t, cache_t, 8>;
        if (head_dim == 256) item_fn = &attend_item_vec<scalar_t, cache_t, 16>;  // Gemma 3
#elif defined(TRAVELATOR_VEC8)
        if (head_dim == 32) item_fn = &attend_item_avx2<scalar_t, cache_t, 4>;
        if (head_dim == 64) item_fn = &attend_item_avx2<scalar_t, cache_t, 8>;
        if (head_dim == 128) item_fn = &attend_item_avx2<scalar_t, cache_t, 16>;
        if (head_dim == 256) item_fn = &attend_item_avx2<scalar_t, cache_t, 32>;  // Gemma 3
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
          if (tiled && items[i].num_queries * (num_heads / num_kv_heads) >= kTiledMinRows && tiled_head) {
            auto* tiled_fn = head_dim == 32 ? &attend_item_tiled<2>
                             : head_dim == 64 ? &attend_item_tiled<4> : &attend_item_tiled<8>;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
            if (on_tiles)
              tiled_fn = head_dim == 32 ? &attend_item_tiled<2, true>
                         : head_dim == 64 ? &attend_item_tiled<4, true> : &attend_item_tiled<8, true>;
#endif
            tiled_fn(items[i], q_ptr, k_ptr, v_ptr, out_ptr, qs, lens, table,
                     block_tables.size(1), q.stride(0), num_heads, num_kv_heads, block_size,
                     static_cast<float>(scale), window, sinks);
            continue;
          }
        }
#endif
        item_fn(items[i], q_ptr, k_ptr, v_ptr, out_ptr, qs, lens, table,
                block_tables.size(1), q.stride(0), num_heads, num_kv_heads, head_dim, block_size,
                static_cast<float>(scale), window, sinks);
      }
    }
  });
  for (int64_t r = 0; r < num_requests; ++r)
    if (flash[r]) attend_chunk_flash(q, k_cache, v_cache, out, qs[r], qs[r + 1] - qs[r], lens[r],
                                     table + r * block_tables.size(1), scale);
}

template <typename scalar_t>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    at::Tensor& out, const at::Tensor& query_start, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, double scale, bool tiled, int64_t window, const float* sinks,
                    bool amx_tiles) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run<scalar_t, float>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sinks, amx_tiles);
    case at::kBFloat16: return run<scalar_t, c10::BFloat16>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sinks, amx_tiles);
    case at::kHalf: return run<scalar_t, c10::Half>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sinks, amx_tiles);
    case at::kChar: return run<scalar_t, int8_t>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sinks, amx_tiles);
    default: TORCH_CHECK(false, "paged_attention: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

// q [T, H, D] (rows may be strided, heads contiguous); k_cache, v_cache [num_blocks, KVH, block_size, D]
// (D + 4 for int8 caches: codes, then the row's float32 scale); query_start [B + 1],
// seq_lens [B] (keys after this step's tokens are written), block_tables [B, width]:
// all int64. Request r's queries are rows query_start[r] .. query_start[r + 1] of q, at
// positions seq_lens[r] - q_len .. seq_lens[r] - 1; query i sees keys 0 .. its position p,
// or with a sliding window (window > 0) keys max(0, p - window + 1) .. p. Keys before the
// first one a request's first query sees are never read: the table entries of blocks
// wholly before it may name any block.
// tiled: prefill tiles may take the faster tiled kernel (bf16), and long prefill chunks
// ATen's flash attention (bf16, on AMX CPUs), whose numbers depend on the tile or the chunk;
// without it every row's numbers are independent of the rest of the call.
// sinks [H] (gpt-oss): per query head a logit in every row's softmax with no value.
// amx_tiles: with `tiled`, the tiled kernel's products and long chunks may take AMX's tiles
// where there are; false: the routes of a CPU without them (tests take both here).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, bool tiled, int64_t window,
                           const std::optional<at::Tensor>& sinks, bool amx_tiles) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: none)");
  at::Tensor sinks_f;  // float32, contiguous: read by every row
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "paged_attention: one sink per query head");
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_ptr = sinks.has_value() ? sinks_f.data_ptr<float>() : nullptr;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q must have contiguous heads, the caches must be contiguous");
  const int64_t row = k_cache.scalar_type() == at::kChar ? q.size(2) + 4 : q.size(2);  // int8: codes, then a scale
  TORCH_CHECK(k_cache.size(3) == row && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head shapes do not match");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K/V dtypes differ");
  for (const at::Tensor* t : {&query_start, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(query_start.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "paged_attention: metadata sizes do not match");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[seq_lens.size(0)] == q.size(0), "paged_attention: query_start must span q's rows");
  for (int64_t r = 0; r < seq_lens.size(0); ++r)
    TORCH_CHECK(qs[r + 1] >= qs[r] && lens[r] >= qs[r + 1] - qs[r] && lens[r] <= block_tables.size(1) * k_cache.size(2),
                "paged_attention: request ", r, " has ", qs[r + 1] - qs[r], " queries, ", lens[r],
                " keys and a table of ", block_tables.size(1), " blocks");
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sink_ptr, amx_tiles); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sink_ptr, amx_tiles); break;
    case at::kHalf: dispatch_cache<c10::Half>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window, sink_ptr, amx_tiles); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(travelator, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start, "
        "Tensor seq_lens, Tensor block_tables, float scale, bool tiled=False, int window=0, "
        "Tensor? sinks=None, bool amx_tiles=True) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  // Whether long bf16 prefill chunks take ATen's flash attention here (attention_flash.h).
  m.def("attention_flash_route() -> bool", &travelator::attention::flash_route_available);
}
