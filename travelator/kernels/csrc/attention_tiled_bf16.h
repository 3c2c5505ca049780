// The tiled prefill path of paged_attention.cpp: bf16 queries and cache on AVX512-BF16,
// query rows in vector lanes (outside batch-invariant mode only).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_common.h"
#include "attention_tiles_amx.h"
#include "kv_layout.h"
#include "vec16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace travelator::attention {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Prefill tiles with bf16 queries and cache, where the caller lets a row's numbers depend
// on its tile (not batch_invariant): the query rows lie in the 16 lanes of a vector, so
// that Q.K and P.V are small matrix products on vdpbf16ps with no horizontal sums, and
// the online softmax runs down the lanes. P is rounded to bf16 for P.V (FlashAttention
// does the same); the row sums l keep float P. Keys are taken kTiledKeys at a time.
// kAmx: the two products on AMX's tiles (attention_tiles_amx.h), the softmax as here.
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

// The first key of a chunk, its keys (nk), those padded to a step of the scores, and their
// pairs (padded to a tile's 16 with kAmx).
struct TiledChunk {
  int64_t chunk0, nk, nk_padded, n_pairs, pairs_padded;
};

// One work item of the tiled kernel: the call's arguments, the item's shape, and the buffers
// every head of it reuses. Each step below is one function; attend_item_tiled runs them.
template <int64_t kChunks, bool kAmx>
struct TiledItem {
  static constexpr int64_t D = 16 * kChunks, kPairs = D / 2;
  static constexpr int64_t kKeyStep = kAmx ? 16 : 8;  // keys a step of the scores takes

  const c10::BFloat16 *q, *k_cache, *v_cache;
  c10::BFloat16* out;
  int64_t q_stride, num_heads, num_kv_heads;
  float scale;
  int64_t window;
  const float* sinks;

  int64_t bs, group, bs_shift, first_pos, n_keys, key_begin, rows, nrb, rpad, token0;
  const int64_t* table;

  std::vector<uint32_t> qt, pp;
  std::vector<float> acc, s, lsum, msum;
  std::vector<__m512bh> vi;
  std::vector<__m512> m, l;
  std::vector<__m512i> row_pos, row_first;  // per lane: its position, its first key
  std::vector<int64_t> rb_first_pos, rb_last_first;  // per block of rows: the least, the greatest
  std::vector<int64_t> key_offset;
  // With kAmx: the chunk's keys gathered where a block does not hold a multiple of 16 of
  // them (the tile of keys reads 16 rows at a stride), and a row block's P row-major, as the
  // tile of P reads it.
  std::vector<c10::BFloat16> keys;
  std::vector<uint32_t> p_rows;
  __m512i lo, hi, pair;

  TiledItem(const WorkItem& w, const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
            c10::BFloat16* out, const int64_t* query_start, const int64_t* seq_lens, const int64_t* block_tables,
            int64_t table_width, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
            float scale, int64_t window, const float* sinks)
      : q(q), k_cache(k_cache), v_cache(v_cache), out(out), q_stride(q_stride), num_heads(num_heads),
        num_kv_heads(num_kv_heads), scale(scale), window(window), sinks(sinks) {
    bs = block_size, group = num_heads / num_kv_heads;
    bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(bs)) : -1;
    const int64_t q_len = query_start[w.request + 1] - query_start[w.request];
    first_pos = seq_lens[w.request] - q_len + w.first_query;  // the item's query 0
    n_keys = first_pos + w.num_queries;  // keys visible to its last query
    key_begin = first_key(first_pos, window);  // the first key its query 0 sees
    rows = w.num_queries * group;  // row = query * group + r
    nrb = (rows + 15) / 16, rpad = nrb * 16;
    token0 = query_start[w.request] + w.first_query;
    table = block_tables + w.request * table_width;
    allocate();
    pair_indices();
  }

  void allocate() {
    qt.resize(nrb * kPairs * 16), pp.resize(kTiledKeys / 2 * rpad);
    acc.resize(rpad * D), s.resize(kTiledKeys * rpad), lsum.resize(rpad), msum.resize(rpad);
    vi.resize(kTiledKeys / 2 * kChunks);
    m.resize(nrb), l.resize(nrb);
    row_pos.resize(nrb), row_first.resize(nrb);
    rb_first_pos.resize(nrb), rb_last_first.resize(nrb);
    key_offset.resize(kTiledKeys);
    keys.resize(kAmx && bs % 16 != 0 ? kTiledKeys * D : 0);
    p_rows.resize(kAmx ? nrb * kTiledKeys / 2 * 16 : 0);
  }

  // (a0, b0, a1, b1, ...): the bf16 of two vectors interleaved, as pairs, low then high half.
  void pair_indices() {
    alignas(64) int16_t lo_idx[32], hi_idx[32], pair_idx[32];
    for (int i = 0; i < 16; ++i) {
      lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
      hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
      pair_idx[2 * i] = i, pair_idx[2 * i + 1] = 16 + i;
    }
    lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx), pair = _mm512_load_si512(pair_idx);
  }

  static void configure_tiles() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (kAmx) amx::configure();
#endif
  }

  static void release_tiles() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (kAmx) _tile_release();
#endif
  }

  // Q transposed: lane i of qt[rb][p] is dims (2p, 2p+1) of row rb * 16 + i; padded rows
  // repeat the last one (computed, never written).
  void transpose_queries(int64_t h) {
    const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q + token0 * q_stride + h * group * D);
    for (int64_t rb = 0; rb < nrb; ++rb) {
      alignas(64) int32_t row_at[16];  // each lane's row, in pairs from q_pairs
      for (int i = 0; i < 16; ++i) {
        const int64_t rr = std::min(rb * 16 + i, rows - 1);
        row_at[i] = static_cast<int32_t>(((rr / group) * q_stride + (rr % group) * D) / 2);
      }
      const __m512i at = _mm512_load_si512(row_at);
      for (int64_t p = 0; p < kPairs; ++p)
        _mm512_storeu_si512(&qt[(rb * kPairs + p) * 16], _mm512_i32gather_epi32(at, q_pairs + p, 4));
    }
  }

  // Each row block's positions and windows; m, l and acc as no key has been seen.
  void reset_rows() {
    for (int64_t rb = 0; rb < nrb; ++rb) {
      alignas(64) int32_t pos[16], first[16];
      for (int i = 0; i < 16; ++i) {
        pos[i] = static_cast<int32_t>(first_pos + std::min(rb * 16 + i, rows - 1) / group);
        first[i] = static_cast<int32_t>(first_key(pos[i], window));
      }
      row_pos[rb] = _mm512_load_si512(pos);
      row_first[rb] = _mm512_load_si512(first);
      rb_first_pos[rb] = *std::min_element(pos, pos + 16);
      rb_last_first[rb] = *std::max_element(first, first + 16);
      m[rb] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      l[rb] = _mm512_setzero_ps();
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
  }

  TiledChunk chunk_at(int64_t chunk0) const {
    const int64_t nk = std::min(kTiledKeys, n_keys - chunk0);
    const int64_t nk_padded = (nk + kKeyStep - 1) / kKeyStep * kKeyStep, n_pairs = (nk + 1) / 2;
    const int64_t pairs_padded = kAmx ? (n_pairs + 15) / 16 * 16 : n_pairs;
    return {chunk0, nk, nk_padded, n_pairs, pairs_padded};
  }

  // Keys past nk repeat the last one, keys before key_begin the first one (in bounds and
  // in the window; masked below).
  void key_offsets(const TiledChunk& c, int64_t h) {
    for (int64_t j = 0; j < c.nk_padded; ++j) {
      const int64_t pos = std::max(key_begin, c.chunk0 + std::min(j, c.nk - 1));
      const int64_t block = bs_shift >= 0 ? pos >> bs_shift : pos / bs;  // a division costs more than the rest
      key_offset[j] = travelator::kv_row(table[block], h, pos - block * bs, num_kv_heads, bs) * D;
    }
  }

  // (1) scores, s[j][row]: on the tiles 16 keys x 16 rows at a time, else 8 x 16.
  void scores(const TiledChunk& c) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (kAmx) scores_on_tiles(c);
#endif
    if constexpr (!kAmx) scores_on_vectors(c);
  }

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  // With blocks of a multiple of 16 positions a tile's 16 keys lie in one block, read
  // in place (tiles wholly before key_begin are not read: their blocks may be gone);
  // else they are gathered (from key_begin on, as key_offset has them).
  void scores_on_tiles(const TiledChunk& c) {
    const c10::BFloat16* tile_keys[kTiledKeys / 16];
    for (int64_t j0 = 0; j0 < c.nk_padded; j0 += 16) {
      const int64_t pos = std::max(key_begin, c.chunk0 + j0);
      if (bs % 16 == 0) {
        tile_keys[j0 / 16] = pos < c.chunk0 + j0 + 16 ? k_cache + key_offset[j0] - (pos % 16) * D : nullptr;
      } else {
        for (int64_t j = j0; j < j0 + 16; ++j) std::memcpy(&keys[j * D], k_cache + key_offset[j], D * sizeof(c10::BFloat16));
        tile_keys[j0 / 16] = &keys[j0 * D];
      }
    }
    for (int64_t rb = 0; rb < nrb; ++rb) {
      amx::scores<D>(tile_keys, c.nk_padded, &qt[rb * kPairs * 16], &s[rb * 16], rpad);
      for (int64_t j = 0; j < c.nk; ++j)
        _mm512_storeu_ps(&s[j * rpad + rb * 16], _mm512_mul_ps(_mm512_loadu_ps(&s[j * rpad + rb * 16]), _mm512_set1_ps(scale)));
    }
  }
#endif

  void scores_on_vectors(const TiledChunk& c) {
    for (int64_t rb = 0; rb < nrb; ++rb) {
      const uint32_t* qrb = &qt[rb * kPairs * 16];
      for (int64_t j0 = 0; j0 < c.nk_padded; j0 += 8) {
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
          if (j0 + u < c.nk) _mm512_storeu_ps(&s[(j0 + u) * rpad + rb * 16], _mm512_mul_ps(a[u], _mm512_set1_ps(scale)));
      }
    }
  }

  // The lanes of row block rb that see the key at `key`: row_first <= key <= row_pos.
  __mmask16 sees(int64_t key, int64_t rb) const {
    const __m512i k = _mm512_set1_epi32(static_cast<int>(key));
    return _mm512_mask_cmpge_epi32_mask(_mm512_cmple_epi32_mask(k, row_pos[rb]), k, row_first[rb]);
  }

  __mmask16 seen_by(bool whole, int64_t key, int64_t rb) const {
    return whole ? static_cast<__mmask16>(0xFFFF) : sees(key, rb);
  }

  // (2) online softmax down the lanes; p is exactly 0 where a row does not see a key.
  void softmax(const TiledChunk& c, int64_t rb) {
    // Where every row of the block sees every key of the chunk (all but the diagonal's
    // chunks, without a window), no key is masked.
    const bool whole = rb_last_first[rb] <= c.chunk0 && rb_first_pos[rb] >= c.chunk0 + c.nk - 1;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    __m512 mx = _mm512_set1_ps(neg_inf);
    for (int64_t j = 0; j < c.nk; ++j)
      mx = _mm512_mask_max_ps(mx, seen_by(whole, c.chunk0 + j, rb), mx, _mm512_loadu_ps(&s[j * rpad + rb * 16]));
    const __m512 m_new = _mm512_max_ps(m[rb], mx);
    // Without a window every row sees key 0, so m_new is finite from the first chunk on.
    // Under one, a later row may see none of the tile's first chunk: its m stays -inf
    // and its alpha is 0 (l and acc are still 0 there), not exp(-inf + inf).
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(seen, travelator::vec16::exp(_mm512_sub_ps(m[rb], m_new)));
    const __m512 sum = p_pairs(c, rb, whole, m_new);
    l[rb] = _mm512_fmadd_ps(l[rb], alpha, sum);
    m[rb] = m_new;
    rescale(rb, alpha);
  }

  // P = exp(s - m_new) of row block rb into pp as bf16 pairs; returns its row sums.
  __m512 p_pairs(const TiledChunk& c, int64_t rb, bool whole, __m512 m_new) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < 2 * c.n_pairs; j += 2) {
      __m512 p2[2];
      for (int u = 0; u < 2; ++u) {
        if (j + u < c.nk) {
          p2[u] = _mm512_maskz_mov_ps(seen_by(whole, c.chunk0 + j + u, rb),
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
    return sum;
  }

  // acc of row block rb times alpha, row by row.
  void rescale(int64_t rb, __m512 alpha) {
    // alpha is 1 in every row once their largest scores have been seen.
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) == 0) return;
    alignas(64) float alpha_lanes[16];
    _mm512_store_ps(alpha_lanes, alpha);
    for (int i = 0; i < 16; ++i) {
      float* a = &acc[(rb * 16 + i) * D];
      const __m512 al = _mm512_set1_ps(alpha_lanes[i]);
      for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), al));
    }
  }

  // P row-major for its tile, written well before the tile reads it (a tile's load waits
  // for the stores before it to reach the cache).
  void p_rows_for_tiles([[maybe_unused]] const TiledChunk& c) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (kAmx) {
      for (int64_t rb = 0; rb < nrb; ++rb)
        for (int64_t ks = 0; ks < c.pairs_padded / 16; ++ks)
          amx::transpose_pairs(&pp[ks * 16 * rpad + rb * 16], rpad, c.n_pairs - ks * 16,
                               &p_rows[(rb * kTiledKeys / 2 + 16 * ks) * 16]);
    }
#endif
  }

  // (3) V as key pairs: lane d of vi[jp][c] is (V[2jp][16c + d], V[2jp + 1][16c + d]).
  // Pairs past the keys, where P is 0: zero, so that no stale value (a NaN among them)
  // meets that 0.
  void values_as_pairs(const TiledChunk& ch) {
    for (int64_t jp = ch.n_pairs; jp < ch.pairs_padded; ++jp)
      for (int64_t c = 0; c < kChunks; ++c) vi[jp * kChunks + c] = (__m512bh)_mm512_setzero_si512();
    for (int64_t jp = 0; jp < ch.n_pairs; ++jp) {
      const c10::BFloat16* v0 = v_cache + key_offset[2 * jp];
      const c10::BFloat16* v1 = v_cache + key_offset[std::min(2 * jp + 1, ch.nk_padded - 1)];
      for (int64_t c2 = 0; c2 < kChunks / 2; ++c2) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c2), b = _mm512_loadu_si512(v1 + 32 * c2);
        vi[jp * kChunks + 2 * c2] = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);
        vi[jp * kChunks + 2 * c2 + 1] = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
      }
    }
  }

  // (4) acc += P.V: on the tiles 16 rows at a time, else for the real rows, a few at a time.
  void add_pv(const TiledChunk& c) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (kAmx) {
      for (int64_t rb = 0; rb < nrb; ++rb)
        amx::add_pv<D>(&acc[rb * 16 * D], &p_rows[rb * kTiledKeys / 2 * 16], vi.data(), c.pairs_padded / 16);
    }
#endif
    if constexpr (!kAmx) {
      for (int64_t r0 = 0; r0 < rows; r0 += 20 / kChunks) {
        const int64_t nr = std::min<int64_t>(20 / kChunks, rows - r0);
        pv_pairs_any<kChunks>(nr, &acc[r0 * D], D, &pp[r0], rpad, vi.data(), c.n_pairs);
      }
    }
  }

  // Head h's rows of the output: acc over the softmax's denominator, as bf16.
  void write_rows(int64_t h) {
    for (int64_t rb = 0; rb < nrb; ++rb) {
      _mm512_storeu_ps(&lsum[rb * 16], l[rb]);
      _mm512_storeu_ps(&msum[rb * 16], m[rb]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      c10::BFloat16* dst = out + ((token0 + r / group) * num_heads + h * group + r % group) * D;
      const float inv = 1.0f / softmax_denominator(lsum[r], msum[r], sinks, h * group + r % group);
      for (int64_t c = 0; c < kChunks; ++c)
        travelator::vec16::store(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(&acc[r * D + 16 * c]), _mm512_set1_ps(inv)),
                                 travelator::vec16::lanes(16));
    }
  }
};

// flatten: every step, and the item's constructor and destructor, inlined here. Were the item
// passed out of line, any intrinsic's store could write its fields, and the hot loops would
// reload them.
template <int64_t kChunks, bool kAmx = false>
__attribute__((flatten))
void attend_item_tiled(const WorkItem& w, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                       const c10::BFloat16* v_cache, c10::BFloat16* out, const int64_t* query_start,
                       const int64_t* seq_lens, const int64_t* block_tables, int64_t table_width,
                       int64_t q_stride, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                       float scale, int64_t window, const float* sinks) {
#if !(defined(__AMX_BF16__) && defined(__AMX_TILE__))
  static_assert(!kAmx, "the tiled kernel's products on AMX's tiles need a build for AMX");
#endif
  TiledItem<kChunks, kAmx> item(w, q, k_cache, v_cache, out, query_start, seq_lens, block_tables, table_width,
                                q_stride, num_heads, num_kv_heads, block_size, scale, window, sinks);
  item.configure_tiles();
  for (int64_t h = w.first_head; h < w.end_head; ++h) {
    item.transpose_queries(h);
    item.reset_rows();
    // Chunks of kTiledKeys absolute positions from the one that holds key_begin.
    for (int64_t chunk0 = item.key_begin / kTiledKeys * kTiledKeys; chunk0 < item.n_keys; chunk0 += kTiledKeys) {
      const TiledChunk c = item.chunk_at(chunk0);
      item.key_offsets(c, h);
      item.scores(c);
      for (int64_t rb = 0; rb < item.nrb; ++rb) item.softmax(c, rb);
      item.p_rows_for_tiles(c);
      item.values_as_pairs(c);
      item.add_pv(c);
    }
    item.write_rows(h);
  }
  item.release_tiles();
}
#endif

}  // namespace travelator::attention
