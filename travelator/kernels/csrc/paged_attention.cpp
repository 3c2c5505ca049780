// Attention over the paged KV cache for one flat batch of any mix of decodes and
// prefill chunks: one call per layer, keys and values read in place through each
// request's block table (no gather into padded copies).
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

#include "float_math.h"
#include "kv_layout.h"
#include "vec16.h"
#include "vec8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQueryTile = 16;  // query rows of one work item (prefill)
// Keys a chunk of the portable and AVX2 paths takes: independent of the block size, for
// batch invariance.
constexpr int64_t kRowKeyChunk = 32;

#if defined(__AVX512F__)
// AVX-512 path: 16 floats a vector. A row's numbers depend only on its own inputs
// here too: every row goes through the same instructions in the same order.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane j of the result is the sum of v[j]'s 16 lanes: a fixed tree of in-register
// shuffles, about a third of the work of sixteen horizontal reductions.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 w[8], z[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 g01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 g23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(g01, g23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(g01, g23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// A cache row is one head's vector of one token: head_dim values, or for an int8 cache
// head_dim codes and then their float32 scale (model/kv_cache.py).
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

struct WorkItem {
  int64_t request;
  int64_t first_query;  // within the request's chunk
  int64_t num_queries;
  int64_t first_head, end_head;  // KV heads [first_head, end_head)
};

template <typename scalar_t, typename cache_t>
void attend_item_head(const WorkItem& w, int64_t kv_head, const scalar_t* q, const cache_t* k_cache,
                 const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                 const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 float scale, int64_t window) {
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
      const float inv = 1.0f / l[row];
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
                 float scale, int64_t window) {
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    attend_item_head(w, h, q, k_cache, v_cache, out, query_start, seq_lens, block_tables,
                     table_width, q_stride, num_heads, num_kv_heads, head_dim, block_size, scale, window);
}

#if defined(__AVX512F__)
// The same work on AVX-512, for head_dim 32, 64, 128 or 256. One item takes every KV head
// of its request. Keys are taken in chunks of kKeyChunk absolute positions (so the
// chunking is the same for a decode, a prefill tile or a whole prompt); per chunk and
// KV head: (1) the scores of every row of the head's query group, 16 keys at a time,
// read in place from the cache (bf16 pairs through vdpbf16ps where q and the cache are
// bf16), (2) one online-softmax update per row, (3) p.V with the accumulators of a few
// rows held in registers while each V row is converted once for all of them.
constexpr int64_t kKeyChunk = 256;

// Ask for the lines of one cache row of `bytes` bytes at p (T0: into L1, else L2), from the
// line it starts in (int8 rows of head_dim + 4 bytes are not line-aligned). The
// kernels issue these one row at a time between their arithmetic: a burst of a whole
// block's lines fills the line-fill buffers and stalls the core until it has arrived.
template <int kHint>
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* end = static_cast<const char*>(p) + bytes;
  for (const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(63));
       line < end; line += 64)
    _mm_prefetch(line, kHint == 0 ? _MM_HINT_T0 : _MM_HINT_T1);
}

#if defined(__AVX512BF16__)
// Scores of one bf16 query row against 16 bf16 key rows (pairs of head_dim lanes).
template <int64_t kChunks>
inline __m512 dots16(const c10::BFloat16* qr, const c10::BFloat16* const* krows,
                     const c10::BFloat16* const* pf_l1 = nullptr, const c10::BFloat16* const* pf_l2 = nullptr) {
  constexpr int64_t kPairs = kChunks / 2;  // 32 bf16 a vector
  __m512bh qv[kPairs];
  for (int64_t c = 0; c < kPairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
  __m512 dots[16];
  for (int64_t j = 0; j < 16; ++j) {
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(krows[j]));
    for (int64_t c = 1; c < kPairs; ++c)
      d = _mm512_dpbf16_ps(d, qv[c], (__m512bh)_mm512_loadu_si512(krows[j] + 32 * c));
    dots[j] = d;
    if (pf_l1 != nullptr) {
      prefetch_row<0>(pf_l1[j], 32 * kChunks);
      prefetch_row<1>(pf_l2[j], 32 * kChunks);
    }
  }
  return transpose_sum16(dots);
}
#endif

// The general case: the 16 key rows converted to float once (kf, [16][D]) for every row.
template <typename scalar_t, int64_t kChunks>
inline __m512 dots16(const scalar_t* qr, const float* kf) {
  __m512 qv[kChunks];
  for (int64_t c = 0; c < kChunks; ++c) qv[c] = load16(qr + 16 * c);
  __m512 dots[16];
  for (int64_t j = 0; j < 16; ++j) {
    __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + j * 16 * kChunks));
    for (int64_t c = 1; c < kChunks; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kf + j * 16 * kChunks + 16 * c), d);
    dots[j] = d;
  }
  return transpose_sum16(dots);
}

// acc[r] += sum_j p[r][j] v_j for R rows and keys j of one group, in order.
template <typename cache_t, int64_t kChunks, int64_t R>
inline void pv_rows(float* acc, const float* p, int64_t n_keys, const cache_t* const* vrows, const cache_t* const* pf_l1) {
  constexpr int64_t D = 16 * kChunks;
  __m512 a[R][kChunks];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChunks; ++c) a[r][c] = _mm512_loadu_ps(acc + r * 16 * kChunks + 16 * c);
  for (int64_t j = 0; j < n_keys; ++j) {
    __m512 v[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) v[c] = load16(vrows[j] + 16 * c);
    const float vs = row_scale(vrows[j], D);
    if (pf_l1 != nullptr) prefetch_row<0>(pf_l1[j], row_width<cache_t>(D) * static_cast<int64_t>(sizeof(cache_t)));
    for (int64_t r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(std::is_same_v<cache_t, int8_t> ? p[r * kKeyChunk + j] * vs : p[r * kKeyChunk + j]);
      for (int64_t c = 0; c < kChunks; ++c) a[r][c] = _mm512_fmadd_ps(pr, v[c], a[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + r * 16 * kChunks + 16 * c, a[r][c]);
}

template <typename cache_t, int64_t kChunks, int64_t R = 16 / kChunks>
inline void pv_any_rows(int64_t rows, float* acc, const float* p, int64_t n_keys, const cache_t* const* vrows,
                        const cache_t* const* pf_l1) {
  if constexpr (R > 1) {
    if (rows < R) return pv_any_rows<cache_t, kChunks, R - 1>(rows, acc, p, n_keys, vrows, pf_l1);
  }
  pv_rows<cache_t, kChunks, R>(acc, p, n_keys, vrows, pf_l1);
}

// Ask for one head's rows of 16 keys into L1: the one burst of a chunk, for its first group.
template <typename cache_t>
inline void prefetch_keys(const cache_t* head_cache, const int64_t* key_offset, int64_t row_bytes) {
  for (int64_t j = 0; j < 16; ++j) {
    if (j > 0 && key_offset[j] == key_offset[j - 1]) continue;  // padding repeats a key
    prefetch_row<0>(head_cache + key_offset[j], row_bytes);
  }
}

template <typename scalar_t, typename cache_t, int64_t kChunks>
void attend_item_vec(const WorkItem& w, const scalar_t* q, const cache_t* k_cache,
                     const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                     const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     float scale, int64_t window) {
  // head_dim / 16 is a compile-time constant, so that q and the accumulators stay in
  // registers (an array indexed by a run-time bound would live on the stack).
  constexpr int64_t D = 16 * kChunks;
  constexpr int64_t kRowBatch = 16 / kChunks;  // accumulators of this many rows in registers
#if defined(__AVX512BF16__)
  constexpr bool kPairDots = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;
#else
  constexpr bool kPairDots = false;
#endif
  (void)head_dim;
  const int64_t bs = block_size, group = num_heads / num_kv_heads;
  const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
  const int64_t first_pos = seq_lens[w.request] - q_len + w.first_query;  // the item's query 0
  const int64_t n_keys = first_pos + w.num_queries;  // keys visible to its last query
  const int64_t key_begin = first_key(first_pos, window);  // the first key its query 0 sees
  const int64_t rows = w.num_queries * group;  // per KV head; row = query * group + r
  const int64_t all_rows = num_kv_heads * rows;  // row h * rows + r: head h's row r
  const int64_t token0 = query_start[w.request] + w.first_query;
  constexpr int64_t kRow = row_width<cache_t>(D);
  // A block holds each head's rows together: head h's row of a key is head_stride past head 0's.
  const int64_t head_stride = bs * kRow;
  const int64_t* table = block_tables + w.request * table_width;

  std::vector<float> m(all_rows, -std::numeric_limits<float>::infinity()), l(all_rows, 0.0f);
  std::vector<float> acc(all_rows * D, 0.0f), s(all_rows * kKeyChunk), kf(kPairDots ? 0 : 16 * D);
  std::vector<int64_t> key_offset(kKeyChunk + 16);
  auto q_row = [&](int64_t h, int64_t row) {
    return q + (token0 + row / group) * q_stride + (h * group + row % group) * D;
  };
  // Whether a row sees any of the 16 keys from `key` on.
  auto sees = [&](int64_t row, int64_t key) {
    const int64_t pos = first_pos + row / group;
    return pos >= key && first_key(pos, window) < key + 16;
  };

  for (int64_t chunk0 = key_begin / kKeyChunk * kKeyChunk; chunk0 < n_keys; chunk0 += kKeyChunk) {
    const int64_t chunk_keys = std::min(kKeyChunk, n_keys - chunk0);
    const int64_t padded = (chunk_keys + 15) / 16 * 16;
    // The first group of 16 keys that holds a key the item sees (0 but in its first chunk
    // under a window).
    const int64_t g_begin = std::max<int64_t>(0, key_begin - chunk0) / 16 * 16;
    // Where each key's rows start in the cache; the padding repeats the last key, and keys
    // before key_begin the first one, so that no read goes past the block table nor before
    // the window (those lanes are masked).
    for (int64_t j = 0; j < padded + 16; ++j) {
      const int64_t pos = std::max(key_begin, chunk0 + std::min(j, chunk_keys - 1));
      key_offset[j] = travelator::kv_row(table[pos / bs], 0, pos % bs, num_kv_heads, bs) * kRow;  // head 0's row
    }
    for (int64_t h = w.first_head; h < w.end_head; ++h)
      prefetch_keys(k_cache + h * head_stride, key_offset.data() + g_begin, kRow * static_cast<int64_t>(sizeof(cache_t)));
    // (1) scores, 16 keys at a time (every head: the cache is read front to back), for
    // every row that sees at least one of them.
    for (int64_t g0 = g_begin; g0 < chunk_keys; g0 += 16) {
      for (int64_t h = w.first_head; h < w.end_head; ++h) {
        // This head's rows of the group, of the next group (to ask for) and its V rows
        // (for step (3), into L2).
        const cache_t *krows[16], *k_next[16], *v_rows[16];
        for (int64_t j = 0; j < 16; ++j) {
          krows[j] = k_cache + key_offset[g0 + j] + h * head_stride;
          k_next[j] = k_cache + key_offset[g0 + 16 + j] + h * head_stride;
          v_rows[j] = v_cache + key_offset[g0 + j] + h * head_stride;
        }
        // Each group's rows are asked for once: while its K is widened, or with the first
        // row's scores.
        bool asked = !kPairDots;
        if constexpr (!kPairDots) {
          for (int64_t j = 0; j < 16; ++j) {
            prefetch_row<0>(k_next[j], kRow * static_cast<int64_t>(sizeof(cache_t)));
            prefetch_row<1>(v_rows[j], kRow * static_cast<int64_t>(sizeof(cache_t)));
            const __m512 ks = _mm512_set1_ps(row_scale(krows[j], D));
            for (int64_t c = 0; c < kChunks; ++c) {
              const __m512 kv = load16(krows[j] + 16 * c);
              _mm512_storeu_ps(&kf[j * D + 16 * c], std::is_same_v<cache_t, int8_t> ? _mm512_mul_ps(kv, ks) : kv);
            }
          }
        }
        for (int64_t row = 0; row < rows; ++row) {
          if (!sees(row, chunk0 + g0)) continue;
          __m512 sv;
          if constexpr (kPairDots) {
            sv = asked ? dots16<kChunks>(q_row(h, row), krows) : dots16<kChunks>(q_row(h, row), krows, k_next, v_rows);
            asked = true;
          }
          else sv = dots16<scalar_t, kChunks>(q_row(h, row), kf.data());
          _mm512_storeu_ps(&s[(h * rows + row) * kKeyChunk + g0], _mm512_mul_ps(sv, _mm512_set1_ps(scale)));
        }
      }
    }
    // (2) online softmax, once per row and chunk: p = exp(s - m_new) over the row's
    // visible keys (lanes j0 .. n_valid - 1), exactly 0 elsewhere (so that (3) may run rows
    // of different lengths together: adding 0 * v changes nothing); acc *= exp(m_old - m_new).
    // Lanes from g_begin on are written: the ones (3) reads.
    for (int64_t hr = w.first_head * rows; hr < w.end_head * rows; ++hr) {
      const int64_t pos = first_pos + (hr % rows) / group;
      const int64_t n_valid = std::min(chunk_keys, pos + 1 - chunk0);
      const int64_t j0 = std::max<int64_t>(0, first_key(pos, window) - chunk0);
      float* sr = &s[hr * kKeyChunk];
      if (n_valid <= j0) {
        std::fill(sr + g_begin, sr + padded, 0.0f);
        continue;
      }
      // Lanes of the group from g0 that hold keys j0 .. n_valid - 1.
      auto lanes_of = [&](int64_t g0) {
        const int64_t hi = n_valid - g0, lo = j0 - g0;
        const uint32_t below_hi = hi >= 16 ? 0xFFFFu : hi <= 0 ? 0u : (1u << hi) - 1;
        const uint32_t from_lo = lo <= 0 ? 0xFFFFu : lo >= 16 ? 0u : 0xFFFFu & ~((1u << lo) - 1);
        return static_cast<__mmask16>(below_hi & from_lo);
      };
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t g0 = j0 / 16 * 16; g0 < n_valid; g0 += 16)
        mx = _mm512_mask_max_ps(mx, lanes_of(g0), mx, _mm512_loadu_ps(sr + g0));
      const float m_new = std::max(m[hr], _mm512_reduce_max_ps(mx));
      const __m512 m_vec = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t g0 = g_begin; g0 < padded; g0 += 16) {
        const __m512 p = _mm512_maskz_mov_ps(lanes_of(g0), travelator::vec16::exp(_mm512_sub_ps(_mm512_loadu_ps(sr + g0), m_vec)));
        _mm512_storeu_ps(sr + g0, p);
        sum = _mm512_add_ps(sum, p);
      }
      const float alpha = travelator::exp_approx(m[hr] - m_new);  // ~0 on the first chunk
      l[hr] = l[hr] * alpha + _mm512_reduce_add_ps(sum);
      m[hr] = m_new;
      const __m512 alpha_vec = _mm512_set1_ps(alpha);
      for (int64_t c = 0; c < kChunks; ++c)
        _mm512_storeu_ps(&acc[hr * D + 16 * c], _mm512_mul_ps(_mm512_loadu_ps(&acc[hr * D + 16 * c]), alpha_vec));
    }
    // (3) acc += p.V, 16 keys at a time, a few rows at a time, each V row converted once
    // for all of them.
    for (int64_t g0 = g_begin; g0 < chunk_keys; g0 += 16) {
      for (int64_t h = w.first_head; h < w.end_head; ++h) {
        const cache_t *vrows[16], *v_next[16];
        for (int64_t j = 0; j < 16; ++j) {
          vrows[j] = v_cache + key_offset[g0 + j] + h * head_stride;
          v_next[j] = v_cache + key_offset[g0 + 16 + j] + h * head_stride;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kRowBatch) {
          const int64_t nr = std::min(kRowBatch, rows - r0);
          // Keys of this group seen by the batch's last (latest) row; none of them, when
          // they all lie before the window of its first (earliest) row.
          const int64_t keys = std::min<int64_t>(16, first_pos + (r0 + nr - 1) / group + 1 - (chunk0 + g0));
          if (keys <= 0 || first_key(first_pos + r0 / group, window) >= chunk0 + g0 + 16) continue;
          pv_any_rows<cache_t, kChunks>(nr, &acc[(h * rows + r0) * D], &s[(h * rows + r0) * kKeyChunk + g0],
                                        std::min(keys, chunk_keys - g0), vrows, r0 == 0 ? v_next : nullptr);
        }
      }
    }
  }
  for (int64_t hr = w.first_head * rows; hr < w.end_head * rows; ++hr) {
    const int64_t h = hr / rows, row = hr % rows;
    scalar_t* dst = out + ((token0 + row / group) * num_heads + h * group + row % group) * D;
    const float inv = 1.0f / l[hr];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[hr * D + d] * inv);
  }
}
#endif

#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;

// AVX2 path (8 floats a vector), for head_dim 32, 64, 128 or 256 on CPUs without AVX-512.
// One KV head at a time, keys in chunks of kRowKeyChunk absolute positions (as the
// portable path); per row and chunk: the scores (a dot product per key, read in place from
// the cache and widened to float, then summed across lanes in a fixed order), an
// online-softmax update with an 8-lane exp, and p.V with the row's accumulators held in
// registers. Every row goes through the same instructions whatever else is in the call.
inline float max8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// acc[0 .. 8 * kVecs) += sum over the keys j < n of p[j] v_j[0 .. 8 * kVecs), in order.
template <typename cache_t, int64_t kVecs>
inline void pv_row_avx2(float* acc, const float* p, const cache_t* const* vrows, int64_t n, int64_t offset) {
  __m256 a[kVecs];
  for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm256_fmadd_ps(pj, v8::load(vrows[j] + offset + 8 * c), a[c]);
  }
  for (int64_t c = 0; c < kVecs; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

template <typename scalar_t, typename cache_t, int64_t kChunks>
void attend_item_head_avx2(const WorkItem& w, int64_t kv_head, const scalar_t* q, const cache_t* k_cache,
                           const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                           const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width,
                           int64_t q_stride, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           float scale, int64_t window) {
  constexpr int64_t D = 8 * kChunks, C = kRowKeyChunk, kRow = row_width<cache_t>(D);
  constexpr int64_t kHalf = kChunks > 8 ? 8 : kChunks;  // accumulators in registers at once
  const int64_t bs = block_size, group = num_heads / num_kv_heads;
  const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
  const int64_t first_pos = seq_lens[w.request] - q_len + w.first_query;  // the item's query 0
  const int64_t rows = w.num_queries * group;
  const int64_t n_keys = first_pos + w.num_queries;  // keys visible to its last query
  const int64_t key_begin = first_key(first_pos, window);  // the first key its query 0 sees
  const int64_t token0 = query_start[w.request] + w.first_query;
  const int64_t* table = block_tables + w.request * table_width;

  std::vector<float> qf(rows * D), acc(rows * D, 0.0f), s(C), m(rows, -std::numeric_limits<float>::infinity()),
      l(rows, 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    const scalar_t* src = q + (token0 + row / group) * q_stride + (kv_head * group + row % group) * D;
    for (int64_t d = 0; d < D; ++d) qf[row * D + d] = static_cast<float>(src[d]) * scale;
  }
  const cache_t* krows[C];
  const cache_t* vrows[C];
  float kscale[C], vscale[C];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Chunks of C absolute positions from the one that holds key_begin; keys before it are
  // never read.
  for (int64_t key0 = key_begin / C * C; key0 < n_keys; key0 += C) {
    const int64_t valid = std::min(C, n_keys - key0);
    for (int64_t j = std::max<int64_t>(0, key_begin - key0); j < valid; ++j) {
      const int64_t pos = key0 + j;
      const int64_t offset = travelator::kv_row(table[pos / bs], kv_head, pos % bs, num_kv_heads, bs) * kRow;
      krows[j] = k_cache + offset;
      vrows[j] = v_cache + offset;
      kscale[j] = row_scale(krows[j], D);
      vscale[j] = row_scale(vrows[j], D);
    }
    for (int64_t row = 0; row < rows; ++row) {
      // The row sees keys key0 + j0 .. key0 + n_valid - 1 of this chunk.
      const int64_t pos = first_pos + row / group;
      const int64_t n_valid = std::min(valid, pos + 1 - key0);
      const int64_t j0 = std::max<int64_t>(0, first_key(pos, window) - key0);
      if (n_valid <= j0) continue;
      const float* qr = &qf[row * D];
      __m256 qv[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) qv[c] = _mm256_loadu_ps(qr + 8 * c);
      for (int64_t j = j0; j < n_valid; ++j) {
        __m256 d0 = _mm256_mul_ps(qv[0], v8::load(krows[j]));
        __m256 d1 = _mm256_mul_ps(qv[1], v8::load(krows[j] + 8));
        for (int64_t c = 2; c < kChunks; c += 2) {
          d0 = _mm256_fmadd_ps(qv[c], v8::load(krows[j] + 8 * c), d0);
          d1 = _mm256_fmadd_ps(qv[c + 1], v8::load(krows[j] + 8 * c + 8), d1);
        }
        s[j] = v8::sum(_mm256_add_ps(d0, d1)) * kscale[j];
      }
      // Online softmax: p = exp(s - m_new) over the visible keys (lanes j0 .. n_valid - 1),
      // 0 in the lanes before and past them.
      const float neg_inf = -std::numeric_limits<float>::infinity();
      auto live_lanes = [&](int64_t g0) {
        const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n_valid - g0)), lane);
        const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(j0 - g0)), lane);
        return _mm256_castsi256_ps(_mm256_andnot_si256(before, past));
      };
      __m256 mx = _mm256_set1_ps(neg_inf);
      for (int64_t g0 = j0 / 8 * 8; g0 < n_valid; g0 += 8)
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(neg_inf), _mm256_loadu_ps(&s[g0]), live_lanes(g0)));
      const float m_new = std::max(m[row], max8(mx));
      const __m256 m_vec = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t g0 = j0 / 8 * 8; g0 < n_valid; g0 += 8) {
        const __m256 p = _mm256_and_ps(live_lanes(g0), v8::exp(_mm256_sub_ps(_mm256_loadu_ps(&s[g0]), m_vec)));
        _mm256_storeu_ps(&s[g0], p);
        sum = _mm256_add_ps(sum, p);
      }
      const float alpha = travelator::exp_approx(m[row] - m_new);  // ~0 on the first chunk
      l[row] = l[row] * alpha + v8::sum(sum);
      m[row] = m_new;
      float* a = &acc[row * D];
      const __m256 alpha_vec = _mm256_set1_ps(alpha);
      for (int64_t c = 0; c < kChunks; ++c) _mm256_storeu_ps(a + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), alpha_vec));
      if constexpr (std::is_same_v<cache_t, int8_t>)
        for (int64_t j = j0; j < n_valid; ++j) s[j] *= vscale[j];
      for (int64_t half = 0; half < kChunks; half += kHalf)
        pv_row_avx2<cache_t, kHalf>(a + 8 * half, s.data() + j0, vrows + j0, n_valid - j0, 8 * half);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    scalar_t* dst = out + ((token0 + row / group) * num_heads + kv_head * group + row % group) * D;
    const float inv = 1.0f / l[row];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[row * D + d] * inv);
  }
}

template <typename scalar_t, typename cache_t, int64_t kChunks>
void attend_item_avx2(const WorkItem& w, const scalar_t* q, const cache_t* k_cache,
                      const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                      const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      float scale, int64_t window) {
  (void)head_dim;
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    attend_item_head_avx2<scalar_t, cache_t, kChunks>(w, h, q, k_cache, v_cache, out, query_start, seq_lens,
                                                     block_tables, table_width, q_stride, num_heads,
                                                     num_kv_heads, block_size, scale, window);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Prefill tiles with bf16 queries and cache, where the caller lets a row's numbers depend
// on its tile (not batch_invariant): the query rows lie in the 16 lanes of a vector, so
// that Q.K and P.V are small matrix products on vdpbf16ps with no horizontal sums, and
// the online softmax runs down the lanes. P is rounded to bf16 for P.V (FlashAttention
// does the same); the row sums l keep float P. Keys are taken kTiledKeys at a time.
constexpr int64_t kTiledKeys = 64;
constexpr int64_t kTiledMinRows = 16;  // below this the row-wise kernel is as fast

// acc[r] += sum over key pairs of p-pair[r] . V-pair, R rows at a time.
template <int64_t kChunks, int64_t R>
inline void pv_pairs(float* acc, int64_t acc_stride, const uint32_t* pp, int64_t pp_stride,
                     const __m512bh* vi, int64_t n_pairs) {
  __m512 a[R][kChunks];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChunks; ++c) a[r][c] = _mm512_loadu_ps(acc + r * acc_stride + 16 * c);
  for (int64_t jp = 0; jp < n_pairs; ++jp) {
    const __m512bh* v = vi + jp * kChunks;
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp * pp_stride + r]));
      for (int64_t c = 0; c < kChunks; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], p);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + r * acc_stride + 16 * c, a[r][c]);
}

template <int64_t kChunks, int64_t R = 20 / kChunks>
inline void pv_pairs_any(int64_t rows, float* acc, int64_t acc_stride, const uint32_t* pp, int64_t pp_stride,
                         const __m512bh* vi, int64_t n_pairs) {
  if constexpr (R > 1) {
    if (rows < R) return pv_pairs_any<kChunks, R - 1>(rows, acc, acc_stride, pp, pp_stride, vi, n_pairs);
  }
  pv_pairs<kChunks, R>(acc, acc_stride, pp, pp_stride, vi, n_pairs);
}

template <int64_t kChunks>
void attend_item_tiled(const WorkItem& w, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                       const c10::BFloat16* v_cache, c10::BFloat16* out, const int64_t* query_start,
                       const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width,
                       int64_t q_stride, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                       float scale, int64_t window) {
  constexpr int64_t D = 16 * kChunks, kPairs = D / 2;
  const int64_t bs = block_size, group = num_heads / num_kv_heads;
  const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
  const int64_t first_pos = seq_lens[w.request] - q_len + w.first_query;  // the item's query 0
  const int64_t n_keys = first_pos + w.num_queries;  // keys visible to its last query
  const int64_t key_begin = first_key(first_pos, window);  // the first key its query 0 sees
  const int64_t rows = w.num_queries * group;  // row = query * group + r
  const int64_t nrb = (rows + 15) / 16, rpad = nrb * 16;
  const int64_t token0 = query_start[w.request] + w.first_query;
  const int64_t* table = block_tables + w.request * table_width;

  std::vector<uint32_t> qt(nrb * kPairs * 16), pp(kTiledKeys / 2 * rpad);
  std::vector<float> acc(rpad * D), s(kTiledKeys * rpad), lsum(rpad);
  std::vector<__m512bh> vi(kTiledKeys / 2 * kChunks);
  std::vector<__m512> m(nrb), l(nrb);
  std::vector<__m512i> row_pos(nrb), row_first(nrb);  // per lane: its position, its first key
  std::vector<int64_t> key_offset(kTiledKeys);
  alignas(64) float alpha_lanes[16];
  // (a0, b0, a1, b1, ...): the bf16 of two vectors interleaved, as pairs, low then high half.
  alignas(64) int16_t lo_idx[32], hi_idx[32], pair_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
    pair_idx[2 * i] = i, pair_idx[2 * i + 1] = 16 + i;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx), pair = _mm512_load_si512(pair_idx);

  for (int64_t h = w.first_head; h < w.end_head; ++h) {
    // Q transposed: lane i of qt[rb][p] is dims (2p, 2p+1) of row rb * 16 + i; padded rows
    // repeat the last one (computed, never written).
    for (int64_t r = 0; r < rpad; ++r) {
      const int64_t rr = std::min(r, rows - 1);
      const uint32_t* src = reinterpret_cast<const uint32_t*>(
          q + (token0 + rr / group) * q_stride + (h * group + rr % group) * D);
      for (int64_t p = 0; p < kPairs; ++p) qt[((r / 16) * kPairs + p) * 16 + r % 16] = src[p];
    }
    for (int64_t rb = 0; rb < nrb; ++rb) {
      alignas(64) int32_t pos[16], first[16];
      for (int i = 0; i < 16; ++i) {
        pos[i] = static_cast<int32_t>(first_pos + std::min(rb * 16 + i, rows - 1) / group);
        first[i] = static_cast<int32_t>(first_key(pos[i], window));
      }
      row_pos[rb] = _mm512_load_si512(pos);
      row_first[rb] = _mm512_load_si512(first);
      m[rb] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      l[rb] = _mm512_setzero_ps();
    }
    std::fill(acc.begin(), acc.end(), 0.0f);

    // Chunks of kTiledKeys absolute positions from the one that holds key_begin.
    for (int64_t chunk0 = key_begin / kTiledKeys * kTiledKeys; chunk0 < n_keys; chunk0 += kTiledKeys) {
      const int64_t nk = std::min(kTiledKeys, n_keys - chunk0);
      const int64_t nk8 = (nk + 7) / 8 * 8, n_pairs = (nk + 1) / 2;
      // Keys past nk repeat the last one, keys before key_begin the first one (in bounds and
      // in the window; masked below).
      for (int64_t j = 0; j < nk8; ++j) {
        const int64_t pos = std::max(key_begin, chunk0 + std::min(j, nk - 1));
        key_offset[j] = travelator::kv_row(table[pos / bs], h, pos % bs, num_kv_heads, bs) * D;
      }
      // (1) scores, 8 keys x 16 rows at a time: s[j][row].
      for (int64_t rb = 0; rb < nrb; ++rb) {
        const uint32_t* qrb = &qt[rb * kPairs * 16];
        for (int64_t j0 = 0; j0 < nk8; j0 += 8) {
          const uint32_t* kr[8];
          for (int u = 0; u < 8; ++u) kr[u] = reinterpret_cast<const uint32_t*>(k_cache + key_offset[j0 + u]);
          __m512 a[8];
          for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
          for (int64_t p = 0; p < kPairs; ++p) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qrb + p * 16);
            for (int u = 0; u < 8; ++u)
              a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kr[u][p])));
          }
          for (int u = 0; u < 8; ++u)
            if (j0 + u < nk) _mm512_storeu_ps(&s[(j0 + u) * rpad + rb * 16], _mm512_mul_ps(a[u], _mm512_set1_ps(scale)));
        }
      }
      // (2) online softmax down the lanes; p is exactly 0 where a row does not see a key.
      // The lanes of row block rb that see the key at `key`: row_first <= key <= row_pos.
      auto sees = [&](int64_t key, int64_t rb) {
        const __m512i k = _mm512_set1_epi32(static_cast<int>(key));
        return _mm512_mask_cmpge_epi32_mask(_mm512_cmple_epi32_mask(k, row_pos[rb]), k, row_first[rb]);
      };
      for (int64_t rb = 0; rb < nrb; ++rb) {
        const float neg_inf = -std::numeric_limits<float>::infinity();
        __m512 mx = _mm512_set1_ps(neg_inf);
        for (int64_t j = 0; j < nk; ++j)
          mx = _mm512_mask_max_ps(mx, sees(chunk0 + j, rb), mx, _mm512_loadu_ps(&s[j * rpad + rb * 16]));
        const __m512 m_new = _mm512_max_ps(m[rb], mx);
        // Without a window every row sees key 0, so m_new is finite from the first chunk on.
        // Under one, a later row may see none of the tile's first chunk: its m stays -inf
        // and its alpha is 0 (l and acc are still 0 there), not exp(-inf + inf).
        const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
        const __m512 alpha = _mm512_maskz_mov_ps(seen, travelator::vec16::exp(_mm512_sub_ps(m[rb], m_new)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < 2 * n_pairs; j += 2) {
          __m512 p2[2];
          for (int u = 0; u < 2; ++u) {
            if (j + u < nk) {
              p2[u] = _mm512_maskz_mov_ps(sees(chunk0 + j + u, rb),
                                          travelator::vec16::exp(_mm512_sub_ps(_mm512_loadu_ps(&s[(j + u) * rpad + rb * 16]), m_new)));
            } else {
              p2[u] = _mm512_setzero_ps();
            }
            sum = _mm512_add_ps(sum, p2[u]);
          }
          // (p_j, p_j+1) of each row as one bf16 pair.
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p2[1], p2[0]);
          _mm512_storeu_si512(&pp[(j / 2) * rpad + rb * 16], _mm512_permutexvar_epi16(pair, both));
        }
        l[rb] = _mm512_fmadd_ps(l[rb], alpha, sum);
        m[rb] = m_new;
        _mm512_store_ps(alpha_lanes, alpha);
        for (int i = 0; i < 16; ++i) {
          float* a = &acc[(rb * 16 + i) * D];
          const __m512 al = _mm512_set1_ps(alpha_lanes[i]);
          for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), al));
        }
      }
      // (3) V as key pairs: lane d of vi[jp][c] is (V[2jp][16c + d], V[2jp + 1][16c + d]).
      for (int64_t jp = 0; jp < n_pairs; ++jp) {
        const c10::BFloat16* v0 = v_cache + key_offset[2 * jp];
        const c10::BFloat16* v1 = v_cache + key_offset[std::min(2 * jp + 1, nk8 - 1)];
        for (int64_t c2 = 0; c2 < kChunks / 2; ++c2) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * c2), b = _mm512_loadu_si512(v1 + 32 * c2);
          vi[jp * kChunks + 2 * c2] = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);
          vi[jp * kChunks + 2 * c2 + 1] = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
        }
      }
      // (4) acc += P.V for the real rows, a few at a time.
      for (int64_t r0 = 0; r0 < rows; r0 += 20 / kChunks) {
        const int64_t nr = std::min<int64_t>(20 / kChunks, rows - r0);
        pv_pairs_any<kChunks>(nr, &acc[r0 * D], D, &pp[r0], rpad, vi.data(), n_pairs);
      }
    }
    for (int64_t rb = 0; rb < nrb; ++rb) _mm512_storeu_ps(&lsum[rb * 16], l[rb]);
    for (int64_t r = 0; r < rows; ++r) {
      c10::BFloat16* dst = out + ((token0 + r / group) * num_heads + h * group + r % group) * D;
      const float inv = 1.0f / lsum[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(acc[r * D + d] * inv);
    }
  }
}
#endif

template <typename scalar_t, typename cache_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         at::Tensor& out, const at::Tensor& query_start, const at::Tensor& seq_lens,
         const at::Tensor& block_tables, double scale, bool tiled, int64_t window) {
  const int64_t num_requests = seq_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t* qs = query_start.data_ptr<int64_t>();
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t n = qs[r + 1] - qs[r];
    for (int64_t t = 0; t < n; t += kQueryTile) items.push_back({r, t, std::min(kQueryTile, n - t), 0, num_kv_heads});
  }
  // Fewer items than threads (one or two requests decoding): split each over its KV heads,
  // so that every thread has work. A row is still computed whole, by the same code.
  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(items.size()) < threads && num_kv_heads > 1) {
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
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  auto cost = [&](const WorkItem& w) {
    const int64_t pos = lens[w.request] - (qs[w.request + 1] - qs[w.request]) + w.first_query;
    return (pos + 1 - first_key(pos, window)) * w.num_queries;
  };
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
  // Without `tiled`, one kernel for every row of the call: the choice depends on the shapes
  // only. With it, items of many rows take the tiled kernel.
  (void)tiled;  // unused where the tiled kernel is not built
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
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
          if (tiled && items[i].num_queries * (num_heads / num_kv_heads) >= kTiledMinRows &&
              (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
            auto* tiled_fn = head_dim == 32 ? &attend_item_tiled<2>
                             : head_dim == 64 ? &attend_item_tiled<4> : &attend_item_tiled<8>;
            tiled_fn(items[i], q.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(),
                     v_cache.data_ptr<cache_t>(), out.data_ptr<scalar_t>(), qs,
                     seq_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                     block_tables.size(1), q.stride(0), num_heads, num_kv_heads, block_size,
                     static_cast<float>(scale), window);
            continue;
          }
        }
#endif
        item_fn(items[i], q.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(),
                v_cache.data_ptr<cache_t>(), out.data_ptr<scalar_t>(), qs,
                seq_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                block_tables.size(1), q.stride(0), num_heads, num_kv_heads, head_dim, block_size,
                static_cast<float>(scale), window);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    at::Tensor& out, const at::Tensor& query_start, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, double scale, bool tiled, int64_t window) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run<scalar_t, float>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window);
    case at::kBFloat16: return run<scalar_t, c10::BFloat16>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window);
    case at::kHalf: return run<scalar_t, c10::Half>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window);
    case at::kChar: return run<scalar_t, int8_t>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window);
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
// tiled: prefill tiles may take the faster tiled kernel (bf16), whose numbers depend on
// the tile; without it every row's numbers are independent of the rest of the call.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, bool tiled, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: none)");
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
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window); break;
    case at::kHalf: dispatch_cache<c10::Half>(q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale, tiled, window); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(travelator, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start, "
        "Tensor seq_lens, Tensor block_tables, float scale, bool tiled=False, int window=0) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
