// The AVX-512 path of paged_attention.cpp (head_dim 32, 64, 128 or 256).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_common.h"
#include "float_math.h"
#include "kv_layout.h"
#include "vec16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace travelator::attention {

#if defined(__AVX512F__)
// AVX-512 path: 16 floats a vector. A row's numbers depend only on its own inputs
// here too: every row goes through the same instructions in the same order.

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

#if defined(__AVX512F__)
// The same work on AVX-512, for head_dim 32, 64, 128 or 256. One item takes every KV head
// of its request. Keys are taken in chunks of kKeyChunk absolute positions (so the
// chunking is the same for a decode, a prefill tile or a whole prompt); per chunk and
// KV head: (1) the scores of every row of the head's query group, 16 keys at a time,
// read in place from the cache (bf16 pairs through vdpbf16ps where q and the cache are
// bf16), (2) one online-softmax update per row, (3) p.V with the accumulators of a few
// rows held in registers while each V row is converted once for all of them.
constexpr int64_t kKeyChunk = 256;

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
  for (int64_t c = 0; c < kChunks; ++c) qv[c] = travelator::vec16::load(qr + 16 * c);
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
    for (int64_t c = 0; c < kChunks; ++c) v[c] = travelator::vec16::load(vrows[j] + 16 * c);
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
                     float scale, int64_t window, const float* sinks) {
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
              const __m512 kv = travelator::vec16::load(krows[j] + 16 * c);
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
    const float inv = 1.0f / softmax_denominator(l[hr], m[hr], sinks, h * group + row % group);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[hr * D + d] * inv);
  }
}
#endif

}  // namespace travelator::attention
