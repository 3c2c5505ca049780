// The two products of attention_tiled_bf16.h's prefill tiles on AMX's tiles, where the
// vector kernel takes them a vdpbf16ps at a time: the scores S^T = K Q^T (keys down, the
// tile's query rows across, the layout its softmax reads, rows in lanes) and acc += P V.
// Every tile here is 16 rows of 64 bytes: 16 x 16 float sums, or 16 rows of 16 bf16 pairs.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <immintrin.h>

namespace travelator::attention::amx {

// Tile 0: scores; 1: keys; 2: transposed queries; 3: sums of P V; 4: P; 5: values.
inline void configure() {
  travelator::AmxTileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// s[j * s_stride + i] = key j . query row i, for keys [0, n_keys) (a multiple of 16): keys
// 16 t .. 16 t + 15 at tiles[t] ([16][kD] bf16; nullptr: not needed, left as they were),
// and the 16 rows of qt (pairs of dims down, rows across: lane i of qt[p] is dims 2p, 2p + 1
// of row i).
template <int64_t kD>
inline void scores(const c10::BFloat16* const* tiles, int64_t n_keys, const uint32_t* qt, float* s, int64_t s_stride) {
  for (int64_t j0 = 0; j0 < n_keys; j0 += 16) {
    if (tiles[j0 / 16] == nullptr) continue;
    _tile_zero(0);
    for (int64_t d0 = 0; d0 < kD; d0 += 32) {
      _tile_loadd(1, tiles[j0 / 16] + d0, kD * 2);
      _tile_loadd(2, qt + d0 / 2 * 16, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s + j0 * s_stride, s_stride * 4);
  }
}

// p_rows[i][jj] = pp[jj * pp_stride + i] for the first n_pairs pairs jj of 16, else 0: 16
// rows' bf16 pairs of P from rows-in-lanes to row-major, as the tile of P reads them.
inline void transpose_pairs(const uint32_t* pp, int64_t pp_stride, int64_t n_pairs, uint32_t* p_rows) {
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(pp_stride)));
  const __mmask16 real = static_cast<__mmask16>((1u << std::min<int64_t>(n_pairs, 16)) - 1u);
  for (int64_t i = 0; i < 16; ++i)
    _mm512_storeu_si512(p_rows + 16 * i, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, stride, pp + i, 4));
}

// acc [16][kD] floats (row stride kD) += P V over 16 ks_count pairs of keys: p_rows, ks_count
// blocks of 16 rows x 16 pairs (transpose_pairs'); vi, the values as key pairs (lane d of
// vi[jp * kD / 16 + c] is the pair of keys 2 jp, 2 jp + 1 at dim 16 c + d).
template <int64_t kD>
inline void add_pv(float* acc, const uint32_t* p_rows, const __m512bh* vi, int64_t ks_count) {
  for (int64_t c = 0; c < kD / 16; ++c) {
    _tile_loadd(3, acc + 16 * c, kD * 4);
    for (int64_t ks = 0; ks < ks_count; ++ks) {
      _tile_loadd(4, p_rows + 256 * ks, 64);
      _tile_loadd(5, vi + 16 * ks * (kD / 16) + c, kD / 16 * 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(3, acc + 16 * c, kD * 4);
  }
}

}  // namespace travelator::attention::amx
#endif
