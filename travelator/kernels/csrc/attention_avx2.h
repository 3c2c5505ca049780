// The AVX2 path of paged_attention.cpp (head_dim 32, 64, 128 or 256), on CPUs without AVX-512.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_common.h"
#include "float_math.h"
#include "kv_layout.h"
#include "vec8.h"

namespace travelator::attention {

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
                           float scale, int64_t window, const float* sinks) {
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
    const float inv = 1.0f / softmax_denominator(l[row], m[row], sinks, kv_head * group + row % group);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[row * D + d] * inv);
  }
}

template <typename scalar_t, typename cache_t, int64_t kChunks>
void attend_item_avx2(const WorkItem& w, const scalar_t* q, const cache_t* k_cache,
                      const cache_t* v_cache, scalar_t* out, const int64_t* query_start,
                      const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width, int64_t q_stride,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      float scale, int64_t window, const float* sinks) {
  (void)head_dim;
  for (int64_t h = w.first_head; h < w.end_head; ++h)
    attend_item_head_avx2<scalar_t, cache_t, kChunks>(w, h, q, k_cache, v_cache, out, query_start, seq_lens,
                                                     block_tables, table_width, q_stride, num_heads,
                                                     num_kv_heads, block_size, scale, window, sinks);
}
#endif

}  // namespace travelator::attention
