// The AVX2 path of paged_attention.cpp (head_dim 32, 64, 128 or 256), on CPUs without AVX-512.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "float_math.h"
#include "kv_layout.h"
#include "vec8.h"

namespace travelator::attention {

#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;

// AVX2 path (8 floats a vector), for head_dim 32, 64, 128 or 256 on CPUs without AVX-512.
// Keys in chunks of kRowKeyChunk absolute positions (as the portable path), read in place.
// The rows of one query that share a KV head (its query heads: they see the same keys) are
// taken kRowBlock at a time, so that each key and value row is read and widened once for up
// to kRowBlock of them. Per row and chunk: the scores (a dot product per key; the lanes of 8
// keys summed at once, in a fixed order per key), an online-softmax update with an 8-lane
// exp, and p.V with the rows' accumulators held in registers. A row's every operation is the
// same whatever the other rows of its block or call, so its result is.
constexpr int64_t kRowBlock = 4;  // rows of one query taken together, at most
constexpr int64_t kHeadsSideBySideQueries = 4;  // items of up to this many queries: KV heads in turn per chunk

// A cache row's 16 values from p as two vectors, in the cache's lane order: bf16 widens with
// one unpack a vector, which leaves values 4..7 and 8..11 swapped (swap_to_lanes).
template <typename cache_t>
inline void load16(const cache_t* p, __m256& a, __m256& b) {
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
  } else {
    a = v8::load(p), b = v8::load(p + 8);
  }
}

// 16 values of a row between their order and load16's (the same swap both ways): q is held in
// the lanes' order, and so are the accumulators of p.V until the row is written.
template <typename cache_t>
inline void swap_to_lanes(__m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    const __m256 a = _mm256_permute2f128_ps(lo, hi, 0x20), b = _mm256_permute2f128_ps(lo, hi, 0x31);
    lo = a, hi = b;
  }
}

// The lane sums of 8 vectors (of 8 keys), key j's in lane j: ((0+1)+(2+3))+((4+5)+(6+7)) of
// its lanes, the same for every key.
inline __m256 sums8(const __m256 (&v)[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The rows of the next chunk of keys of the same KV head (null where there is none), asked
// for (into L2: a chunk of wide heads' rows would fill L1) one key and value row a key while
// this chunk's scores are computed: a request's blocks lie anywhere in the pool, and the
// hardware's prefetchers, which follow addresses in order, stall at each block. Only the
// rows of keys the chunk's first rows score are asked for: with a sliding window, those
// before its first visible key are not.
template <typename cache_t>
struct NextChunk {
  const cache_t* k[kRowKeyChunk];
  const cache_t* v[kRowKeyChunk];
};

// s[r][j] = q_r . k_j * kscale[j] for keys j of [j0, n) (q in lane order, already scaled), in
// groups of 8 keys aligned to the chunk: a key outside [j0, n) is never read. With `next`,
// key j's rows of the next chunk are asked for with it.
template <typename cache_t, int64_t kChunks16, int64_t NR>
inline void scores(const float* const (&q)[NR], const cache_t* const* krows, const float* kscale, int64_t j0,
                   int64_t n, float* const (&s)[NR], const NextChunk<cache_t>* next) {
  for (int64_t g0 = j0 / 8 * 8; g0 < n; g0 += 8) {
    __m256 dots[NR][8];
    for (int64_t jj = 0; jj < 8; ++jj) {
      const int64_t j = g0 + jj;
      if (j < j0 || j >= n) {
#pragma GCC unroll 4
        for (int64_t r = 0; r < NR; ++r) dots[r][jj] = _mm256_setzero_ps();
        continue;
      }
      __m256 d0[NR], d1[NR], a, b;
      if (next != nullptr && next->k[j] != nullptr) {
        constexpr int64_t kBytes = row_width<cache_t>(16 * kChunks16) * static_cast<int64_t>(sizeof(cache_t));
        prefetch_row<1>(next->k[j], kBytes), prefetch_row<1>(next->v[j], kBytes);
      }
      load16(krows[j], a, b);
#pragma GCC unroll 4
      for (int64_t r = 0; r < NR; ++r)
        d0[r] = _mm256_mul_ps(_mm256_loadu_ps(q[r]), a), d1[r] = _mm256_mul_ps(_mm256_loadu_ps(q[r] + 8), b);
#pragma GCC unroll 16
      for (int64_t c = 1; c < kChunks16; ++c) {
        load16(krows[j] + 16 * c, a, b);
#pragma GCC unroll 4
        for (int64_t r = 0; r < NR; ++r) {
          d0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 16 * c), a, d0[r]);
          d1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 16 * c + 8), b, d1[r]);
        }
      }
#pragma GCC unroll 4
      for (int64_t r = 0; r < NR; ++r) dots[r][jj] = _mm256_add_ps(d0[r], d1[r]);
    }
    const __m256 ks = _mm256_loadu_ps(kscale + g0);
    for (int64_t r = 0; r < NR; ++r) _mm256_storeu_ps(s[r] + g0, _mm256_mul_ps(sums8(dots[r]), ks));
  }
}

// The online-softmax update of one row over its scores s[j0, n) (replaced by p = exp(s - m_new),
// times vscale for an int8 cache): m and l move on, and the row's accumulator acc[D] is scaled
// by exp(m_old - m_new).
template <typename cache_t, int64_t D>
inline void softmax_update(float* s, const float* vscale, int64_t j0, int64_t n, float& m, float& l, float* acc) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto live_lanes = [&](int64_t g0) {  // lanes j0 .. n - 1
    const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - g0)), lane);
    const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(j0 - g0)), lane);
    return _mm256_castsi256_ps(_mm256_andnot_si256(before, past));
  };
  __m256 mx = _mm256_set1_ps(neg_inf);
  for (int64_t g0 = j0 / 8 * 8; g0 < n; g0 += 8)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(neg_inf), _mm256_loadu_ps(&s[g0]), live_lanes(g0)));
  const float m_new = std::max(m, v8::max(mx));
  const __m256 m_vec = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t g0 = j0 / 8 * 8; g0 < n; g0 += 8) {
    const __m256 p = _mm256_and_ps(live_lanes(g0), v8::exp(_mm256_sub_ps(_mm256_loadu_ps(&s[g0]), m_vec)));
    _mm256_storeu_ps(&s[g0], p);
    sum = _mm256_add_ps(sum, p);
  }
  const float alpha = travelator::exp_approx(m - m_new);  // ~0 on the first chunk
  l = l * alpha + v8::sum(sum);
  m = m_new;
  const __m256 alpha_vec = _mm256_set1_ps(alpha);
  for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(acc + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), alpha_vec));
  if constexpr (std::is_same_v<cache_t, int8_t>)
    for (int64_t j = j0; j < n; ++j) s[j] *= vscale[j];
}

// acc_r[0 .. 16 * kPass) += sum over the keys j < n of p_r[j] v_j[offset ..] (lane order), in
// order of j, for each of the NR rows. (Every loop of a fixed count is unrolled: else GCC keeps
// a copy of the sums on the stack, stored at every key.)
template <typename cache_t, int64_t NR, int64_t kPass>
inline void pv_rows(float* const (&acc)[NR], const float* const (&p)[NR], const cache_t* const* vrows, int64_t n,
                    int64_t offset) {
  constexpr int64_t V = 2 * kPass;  // vectors of a row
  __m256 a[NR][V];
#pragma GCC unroll 16
  for (int64_t r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int64_t c = 0; c < V; ++c) a[r][c] = _mm256_loadu_ps(acc[r] + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m256 v[V];
#pragma GCC unroll 16
    for (int64_t c = 0; c < kPass; ++c) load16(vrows[j] + offset + 16 * c, v[2 * c], v[2 * c + 1]);
#pragma GCC unroll 16
    for (int64_t r = 0; r < NR; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p[r] + j);
#pragma GCC unroll 16
      for (int64_t c = 0; c < V; ++c) a[r][c] = _mm256_fmadd_ps(pj, v[c], a[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int64_t c = 0; c < V; ++c) _mm256_storeu_ps(acc[r] + 8 * c, a[r][c]);
}

// Rows row0 .. row0 + NR - 1 (one query's, keys [j0, n) of the chunk visible to all) through
// one chunk: their scores, softmax updates and p.V.
template <typename cache_t, int64_t D, int64_t NR>
inline void attend_rows(int64_t row0, float* qf, float* acc, float* m, float* l, float* s, const cache_t* const* krows,
                        const cache_t* const* vrows, const float* kscale, const float* vscale, int64_t j0, int64_t n,
                        const NextChunk<cache_t>* next) {
  constexpr int64_t C = kRowKeyChunk;
  constexpr int64_t kPass = std::min<int64_t>(NR == 1 ? 4 : NR == 2 ? 2 : 1, D / 16);  // 16-value chunks a pass
  float* srow[NR];
  const float* qrow[NR];
  float* arow[NR];
  const float* prow[NR];
  for (int64_t r = 0; r < NR; ++r)
    srow[r] = s + r * C, qrow[r] = qf + (row0 + r) * D, arow[r] = acc + (row0 + r) * D, prow[r] = srow[r] + j0;
  scores<cache_t, D / 16, NR>(qrow, krows, kscale, j0, n, srow, next);
  for (int64_t r = 0; r < NR; ++r)
    softmax_update<cache_t, D>(srow[r], vscale, j0, n, m[row0 + r], l[row0 + r], arow[r]);
  for (int64_t c = 0; c < D; c += 16 * kPass) {
    float* apass[NR];
    for (int64_t r = 0; r < NR; ++r) apass[r] = arow[r] + c;
    pv_rows<cache_t, NR, kPass>(apass, prow, vrows + j0, n - j0, c);
  }
}

// Positions key0 + [j_begin, j_end) of one KV head, as runs of consecutive slots of a block
// (consecutive rows of the cache): fn(j of the run's first, offset of its first row, rows).
template <typename Fn>
inline void for_row_runs(const int64_t* table, int64_t kv_head, int64_t num_kv_heads, int64_t bs, int64_t row_elems,
                         int64_t key0, int64_t j_begin, int64_t j_end, Fn fn) {
  for (int64_t j = j_begin; j < j_end;) {
    const int64_t pos = key0 + j, slot = pos % bs, n = std::min(j_end - j, bs - slot);
    fn(j, travelator::kv_row(table[pos / bs], kv_head, slot, num_kv_heads, bs) * row_elems, n);
    j += n;
  }
}

// The rows of KV head h from key next0 on, a chunk's worth (null past the last key n_keys).
template <typename cache_t>
inline void next_chunk_rows(const int64_t* table, int64_t h, int64_t num_kv_heads, int64_t bs, int64_t row_elems,
                            int64_t next0, int64_t n_keys, const cache_t* k_cache, const cache_t* v_cache,
                            NextChunk<cache_t>& next) {
  std::fill(next.k, next.k + kRowKeyChunk, nullptr);
  for_row_runs(table, h, num_kv_heads, bs, row_elems, next0, 0, std::min(kRowKeyChunk, n_keys - next0),
               [&](int64_t j, int64_t offset, int64_t n) {
                 for (int64_t t = 0; t < n; ++t)
                   next.k[j + t] = k_cache + offset + t * row_elems, next.v[j + t] = v_cache + offset + t * row_elems;
               });
}

// Where one work item's rows lie: per KV head of the item, its queries' rows (a query's
// query heads together), each with its own q (lane order, scaled), softmax state and
// accumulator.
struct ItemRows {
  int64_t group, rows_per_head, first_pos, n_keys, key_begin, token0;
};

template <typename scalar_t, typename cache_t, int64_t D>
void load_queries(const WorkItem& w, const ItemRows& it, const scalar_t* q, int64_t q_stride, float scale, float* qf) {
  const __m256 scale_vec = _mm256_set1_ps(scale);
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    for (int64_t row = 0; row < it.rows_per_head; ++row) {
      const scalar_t* src = q + (it.token0 + row / it.group) * q_stride + (h * it.group + row % it.group) * D;
      float* dst = qf + ((h - w.first_head) * it.rows_per_head + row) * D;
      for (int64_t c = 0; c < D; c += 16) {
        __m256 lo = _mm256_mul_ps(v8::load(src + c), scale_vec), hi = _mm256_mul_ps(v8::load(src + c + 8), scale_vec);
        swap_to_lanes<cache_t>(lo, hi);
        _mm256_storeu_ps(dst + c, lo), _mm256_storeu_ps(dst + c + 8, hi);
      }
    }
}

template <typename scalar_t, typename cache_t, int64_t D>
void write_rows(const WorkItem& w, const ItemRows& it, const float* acc, const float* m, const float* l,
                int64_t num_heads, const float* sinks, scalar_t* out) {
  alignas(32) float row_out[D];
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    for (int64_t row = 0; row < it.rows_per_head; ++row) {
      const int64_t i = (h - w.first_head) * it.rows_per_head + row, head = h * it.group + row % it.group;
      const __m256 inv = _mm256_set1_ps(1.0f / softmax_denominator(l[i], m[i], sinks, head));
      for (int64_t c = 0; c < D; c += 16) {
        __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + c), inv);
        __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + c + 8), inv);
        swap_to_lanes<cache_t>(lo, hi);
        _mm256_store_ps(row_out + c, lo), _mm256_store_ps(row_out + c + 8, hi);
      }
      scalar_t* dst = out + ((it.token0 + row / it.group) * num_heads + head) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(row_out[d]);
    }
}

// Every query of the item through one chunk's keys [key0, key0 + valid) of one KV head; its
// rows from row0 in the item's arrays.
template <typename cache_t, int64_t D>
void attend_chunk(const WorkItem& w, const ItemRows& it, int64_t key0, int64_t valid, int64_t window, int64_t row0,
                  float* qf, float* acc, float* m, float* l, float* s, const cache_t* const* krows,
                  const cache_t* const* vrows, const float* kscale, const float* vscale,
                  const NextChunk<cache_t>* next) {
  for (int64_t query = 0; query < w.num_queries; ++query) {
    // Its rows see keys key0 + j0 .. key0 + n_valid - 1 of this chunk.
    const int64_t pos = it.first_pos + query;
    const int64_t n_valid = std::min(valid, pos + 1 - key0);
    const int64_t j0 = std::max<int64_t>(0, first_key(pos, window) - key0);
    if (n_valid <= j0) continue;
    int64_t row = row0 + query * it.group;
    const int64_t end = row + it.group;
    const auto take = [&](auto rows_now) {
      attend_rows<cache_t, D, rows_now()>(row, qf, acc, m, l, s, krows, vrows, kscale, vscale, j0, n_valid, next);
      row += rows_now();
      next = nullptr;  // asked for once
    };
    static_assert(kRowBlock == 4, "the blocks below are of 4, 2 and 1 rows");
    while (row + 4 <= end) take(std::integral_constant<int64_t, 4>{});
    if (row + 2 <= end) take(std::integral_constant<int64_t, 2>{});
    if (row < end) take(std::integral_constant<int64_t, 1>{});
  }
}

// One work item: chunks of kRowKeyChunk absolute positions from the one that holds its first
// visible key (keys before it are never read). Items of a few queries (decodes) take the KV
// heads in turn in each chunk, as they lie side by side in a block: the reads take each
// block's heads in turn rather than one head's slice of every block. Items of more take a
// head's chunks in turn, its rows' state staying in cache. Either way a row's every step is
// the same.
template <typename scalar_t, typename cache_t, int64_t kChunks>
void attend_item_avx2(const WorkItem& w, const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                      scalar_t* out, const int64_t* query_start, const int64_t* seq_lens, const int64_t* block_tables,
                      int64_t table_width, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, const float* sinks) {
  (void)head_dim;
  constexpr int64_t D = 8 * kChunks, C = kRowKeyChunk, kRow = row_width<cache_t>(D);
  ItemRows it;
  it.group = num_heads / num_kv_heads, it.rows_per_head = w.num_queries * it.group;
  const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
  it.first_pos = seq_lens[w.request] - q_len + w.first_query;  // the item's query 0
  it.n_keys = it.first_pos + w.num_queries;                    // keys visible to its last query
  it.key_begin = first_key(it.first_pos, window);              // the first key its query 0 sees
  it.token0 = query_start[w.request] + w.first_query;
  const int64_t* table = block_tables + w.request * table_width;
  const int64_t rows = (w.end_head - w.first_head) * it.rows_per_head;
  std::vector<float> qf(rows * D), acc(rows * D, 0.0f), s(kRowBlock * C),
      m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.0f);
  load_queries<scalar_t, cache_t, D>(w, it, q, q_stride, scale, qf.data());
  const cache_t* krows[C];
  const cache_t* vrows[C];
  float kscale[C] = {}, vscale[C] = {};  // lanes of keys outside a row's range are read, times 0
  NextChunk<cache_t> next;
  const auto attend = [&](int64_t h, int64_t key0) {
    const int64_t valid = std::min(C, it.n_keys - key0);
    next_chunk_rows(table, h, num_kv_heads, block_size, kRow, key0 + C, it.n_keys, k_cache, v_cache, next);
    for_row_runs(table, h, num_kv_heads, block_size, kRow, key0, std::max<int64_t>(0, it.key_begin - key0), valid,
                 [&](int64_t j, int64_t offset, int64_t n) {
                   for (int64_t t = 0; t < n; ++t) {
                     krows[j + t] = k_cache + offset + t * kRow, vrows[j + t] = v_cache + offset + t * kRow;
                     kscale[j + t] = row_scale(krows[j + t], D), vscale[j + t] = row_scale(vrows[j + t], D);
                   }
                 });
    attend_chunk<cache_t, D>(w, it, key0, valid, window, (h - w.first_head) * it.rows_per_head, qf.data(),
                             acc.data(), m.data(), l.data(), s.data(), krows, vrows, kscale, vscale, &next);
  };
  const int64_t key_first = it.key_begin / C * C;
  if (w.num_queries <= kHeadsSideBySideQueries) {
    for (int64_t key0 = key_first; key0 < it.n_keys; key0 += C)
      for (int64_t h = w.first_head; h < w.end_head; ++h) attend(h, key0);
  } else {  // many rows a head: their state stays in cache while the head's chunks pass
    for (int64_t h = w.first_head; h < w.end_head; ++h)
      for (int64_t key0 = key_first; key0 < it.n_keys; key0 += C) attend(h, key0);
  }
  write_rows<scalar_t, cache_t, D>(w, it, acc.data(), m.data(), l.data(), num_heads, sinks, out);
}
#endif

}  // namespace travelator::attention
