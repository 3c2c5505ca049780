// What every path of paged_attention.cpp shares: the work items, the layout of a cache row,
// and where a sliding window starts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace travelator::attention {

constexpr int64_t kQueryTile = 16;  // query rows of one work item (prefill)
// Keys a chunk of the portable and AVX2 paths takes: independent of the block size, for
// batch invariance.
constexpr int64_t kRowKeyChunk = 32;

// A cache row is one head's vector of one token: head_dim values, or for an int8 cache
// head_dim codes and then their float32 scale (model/kv_layout.py).
template <typename cache_t>
constexpr int64_t row_width(int64_t head_dim) {
  return std::is_same_v<cache_t, int8_t> ? head_dim + 4 : head_dim;
}

// The factor a row's stored values are multiplied by: its scale for int8, else 1.
template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t head_dim) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return scale;
  } else {
    (void)row, (void)head_dim;
    return 1.0f;
  }
}

// The first key position a query at `pos` sees: 0 without a window (window 0), else
// pos - window + 1 (0 near the start).
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The denominator of a row's softmax: the sum l of its keys' weights (each exp(score - m), m the
// row's largest score), plus, with sinks (gpt-oss: per query head a logit that takes a share
// of the softmax and adds no value), exp(sink - m).
inline float softmax_denominator(float l, float m, const float* sinks, int64_t head) {
  return sinks == nullptr ? l : l + std::exp(sinks[head] - m);
}

// Ask for the lines of one cache row of `bytes` bytes at p (kHint 0: into L1, else L2), from
// the line it starts in (int8 rows of head_dim + 4 bytes are not line-aligned). The
// kernels issue these one row at a time between their arithmetic: a burst of a whole
// block's lines fills the line-fill buffers and stalls the core until it has arrived.
template <int kHint>
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* end = static_cast<const char*>(p) + bytes;
  for (const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(63));
       line < end; line += 64)
    __builtin_prefetch(line, 0, kHint == 0 ? 3 : 2);  // prefetcht0, prefetcht1
}

struct WorkItem {
  int64_t request;
  int64_t first_query;  // within the request's chunk
  int64_t num_queries;
  int64_t first_head, end_head;  // KV heads [first_head, end_head)
};

}  // namespace travelator::attention
