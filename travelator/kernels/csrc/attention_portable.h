// The portable path of paged_attention.cpp: plain C++, one KV head at a time, for any
// head_dim and any CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_common.h"
#include "float_math.h"
#include "kv_layout.h"

namespace travelator::attention {

template <typename scalar_t, typename cache_t>
void attend_item_head(const WorkItem& w, int64_t kv_head, const scalar_t* q, const cache_t* k_cache,
                 const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                 const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 float scale, int64_t window, const float* sinks) {
  const int64_t D = head_dim, bs = block_size, row = row_width<cache_t>(D);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
  const int64_t first_pos = seq_lens[w.request] - q_len;  // position of the chunk's query 0
  const int64_t rows = w.num_queries * group;
  // Keys visible to the tile's last query; earlier rows stop sooner (causal).
  const int64_t last_pos = first_pos + w.first_query + w.num_queries - 1;
  // The first key the tile's first query sees; later rows start later (the window).
  const int64_t key_begin = first_key(first_pos + w.first_query, window);

  constexpr int64_t C = kRowKeyChunk;
  std::vector<float> qf(rows * D), acc(rows * D, 0.0f), kt(D * C, 0.0f), vf(C * D), s(C);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.0f);
  for (int64_t i = 0; i < w.num_queries; ++i) {
    const int64_t token = query_start[w.request] + w.first_query + i;
    for (int64_t r = 0; r < group; ++r) {
      const scalar_t* src = q + token * q_stride + (kv_head * group + r) * D;
      float* dst = &qf[(i * group + r) * D];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
  const int64_t* table = block_tables + w.request * table_width;
  // Keys in chunks of C absolute positions, whatever the block size: a row's numbers are
  // then the same for any block size, as on the AVX-512 path. Lanes before key_begin are
  // never gathered (stale numbers, never used).
  for (int64_t key0 = key_begin / C * C; key0 <= last_pos; key0 += C) {
    const int64_t valid_in_chunk = std::min(C, last_pos + 1 - key0);
    for (int64_t j = std::max<int64_t>(0, key_begin - key0); j < valid_in_chunk; ++j) {
      const int64_t key = key0 + j;
      const int64_t offset = travelator::kv_row(table[key / bs], kv_head, key % bs, num_kv_heads, bs) * row;
      const cache_t* kj = k_cache + offset;
      const cache_t* vj = v_cache + offset;
      const float ks = row_scale(kj, D), vs = row_scale(vj, D);
      for (int64_t d = 0; d < D; ++d) kt[d * C + j] = static_cast<float>(kj[d]) * ks;
      for (int64_t d = 0; d < D; ++d) vf[j * D + d] = static_cast<float>(vj[d]) * vs;
    }
    for (int64_t i = 0; i < w.num_queries; ++i) {
      // The row sees keys key0 + j0 .. key0 + n_valid - 1 of this chunk.
      const int64_t pos = first_pos + w.first_query + i;
      const int64_t n_valid = std::min(valid_in_chunk, pos + 1 - key0);
      const int64_t j0 = std::max<int64_t>(0, first_key(pos, window) - key0);
      if (n_valid <= j0) continue;
      for (int64_t r = 0; r < group; ++r) {
        const int64_t row = i * group + r;
        const float* qr = &qf[row * D];
        // Scores of this row against the chunk's keys, summed over d in order (lanes past
        // the keys the row sees are computed from stale numbers and never used).
        for (int64_t j = 0; j < C; ++j) s[j] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qr[d];
          const float* kd = &kt[d * C];
          for (int64_t j = 0; j < C; ++j) s[j] += qd * kd[j];
        }
        float chunk_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < n_valid; ++j) chunk_max = std::max(chunk_max, s[j]);
        const float m_new = std::max(m[row], chunk_max);
        const float alpha = travelator::exp_approx(m[row] - m_new);  // 0 on the first chunk
        float sum = 0.0f;
        for (int64_t j = j0; j < n_valid; ++j) {
          s[j] = travelator::exp_approx(s[j] - m_new);
          sum += s[j];
        }
        l[row] = l[row] * alpha + sum;
        m[row] = m_new;
        float* a = &acc[row * D];
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        for (int64_t j = j0; j < n_valid; ++j) {
          const float p = s[j];
          const float* vrow = &vf[j * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < w.num_queries; ++i) {
    const int64_t token = query_start[w.request] + w.first_query + i;
    for (int64_t r = 0; r < group; ++r) {
      const int64_t row = i * group + r;
      scalar_t* dst = out + (token * num_heads + kv_head * group + r) * D;
      const float inv = 1.0f / softmax_denominator(l[row], m[row], sinks, kv_head * group + r);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[row * D + d] * inv);
    }
  }
}

// Portable path: one KV head at a time.
template <typename scalar_t, typename cache_t>
void attend_item(const WorkItem& w, const scalar_t* q, const cache_t* k_cache,
                 const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                 const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 float scale, int64_t window, const float* sinks) {
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    attend_item_head(w, h, q, k_cache, v_cache, out, query_start, seq_lens, block_tables,
                     table_width, q_stride, num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks);
}

}  // namespace travelator::attention
