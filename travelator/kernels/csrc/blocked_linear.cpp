// y = x W^T (+ bias) in bf16 with float32 sums, on CPUs with AVX512-BF16, with W laid out once at load as [N / 64][K / 2][64][2]: for
// each 64 output columns, every pair of k in order, the 64 columns' two weights side by
// side. One 512-bit load is then 16 columns' pair, the operand vdpbf16ps wants, and a
// block of 64 columns is one front-to-back stream of memory.
//
// Two micro-kernels, chosen by the CPU and the weight's shape, never by the rows of x:
// - Without AMX (vdpbf16ps): 6 rows x 64 columns of sums in 24 registers; per pair of k it
//   loads 4 weight vectors and broadcasts each row's pair of x. Blocks of 64 columns are
//   split over threads; k is taken a slice of a block at a time (16 KB, kept in L1, for a
//   tile of up to three groups of rows; 64 KB, kept in L2, past that), every group of rows
//   passing over it, and while a slice is computed the next one is asked for into L2: a
//   decode step's few rows then compute while the weights stream in, where without it the
//   two took turns. It beats oneDNN's packed bf16 GEMM at a decode step's rows and keeps up
//   with it on long prefills (docs/benchmarks.md).
// - With AMX (where K is a multiple of 32): tiles of 16 rows of x by 16 pairs of k, each
//   multiplied by a tile of 16 pairs of k by 16 columns read in place from the layout (a
//   pair of a block is 256 bytes: the tile's rows are that far apart), into 16 x 16 float
//   sums. Two tiles of rows and two of columns at a time (the eight tile registers: four
//   sums, two of x, two of weights), over all of k, while the passes over a block ask for
//   the thread's next block into L2 and each pass writes out the previous pass's sums.
//   Its operands come from L2 (a block, and x's rows: up to 1 MB of them), and it runs
//   far below the tiles' own peak. It is ahead of oneDNN's AMX GEMM at a decode step's
//   rows, most on small layers, where oneDNN's own cost per call weighs most, and level
//   with it or ahead past them (docs/benchmarks.md).
//
// Each output is summed over k in order, the same way whatever M is and however the rows
// and columns are split: a row's result never depends on the other rows of x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "amx_tiles.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 64;  // output columns of a block: four 16-lane vectors
constexpr int64_t kRows = 6;   // rows of x a micro-kernel call takes: 24 accumulators
constexpr int64_t kKeyPairs = 256;  // pairs of k a pass takes (64 KB of a block), past kFewGroups groups
// With at most kFewGroups groups of rows, a pass takes kFewGroupPairs pairs (16 KB), which
// stays in L1 while the groups after the first pass over it (12 rows, 6 + 6, where only the
// slice changed). More groups amortise their accumulators' loads and stores better over the
// longer pass.
constexpr int64_t kFewGroups = 3;
constexpr int64_t kFewGroupPairs = 64;
constexpr int64_t kRowTileBytes = 384 << 10;  // rows of x taken together: at most this much of x, kept in L2
// The same on AMX tiles, whose x tiles are read from L2 beside a block of weights and the
// next block, asked for meanwhile: a larger tile of rows reads every block from memory
// fewer times on a long prefill. At most kTileRowTileBytes of x, and no more than leaves
// the two blocks room in kTileL2Bytes (the L2 of a core of the AMX CPUs, 2 MB, less a
// margin for the sums and the output).
constexpr int64_t kTileRowTileBytes = 1 << 20;
constexpr int64_t kTileL2Bytes = 1792 << 10;

// Ask for lines [first, stop) of the 64-byte lines from `ahead` into L2: weights a kernel
// reads next, asked for a share at a time between its products.
inline void ask_into_l2(const void* ahead, int64_t first, int64_t stop) {
  for (int64_t line = first; line < stop; ++line)
    _mm_prefetch(static_cast<const char*>(ahead) + 64 * line, _MM_HINT_T1);
}

// acc[r][0..64) += sum over pairs p < n_pairs of x[r] pair p . w pair p, R rows.
// ahead, lines: lines of weights to ask for into L2 meanwhile, spread over the pairs.
template <int64_t R>
inline void micro(const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc,
                  const __m512bh* ahead, int64_t lines) {
  const int64_t per_pair = (lines + n_pairs - 1) / n_pairs;
  __m512 a[R][4];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc + r * kCols + 16 * j);
  for (int64_t p = 0; p < n_pairs; ++p) {
    ask_into_l2(ahead, p * per_pair, std::min(lines, (p + 1) * per_pair));
    const __m512bh w0 = w[4 * p], w1 = w[4 * p + 1], w2 = w[4 * p + 2], w3 = w[4 * p + 3];
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + p]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], xr, w0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], xr, w1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], xr, w2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], xr, w3);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kCols + 16 * j, a[r][j]);
}

template <int64_t R = kRows>
inline void micro_any(int64_t rows, const uint32_t* x, int64_t x_stride, const __m512bh* w, int64_t n_pairs, float* acc,
                      const __m512bh* ahead, int64_t lines) {
  if constexpr (R > 1) {
    if (rows < R) return micro_any<R - 1>(rows, x, x_stride, w, n_pairs, acc, ahead, lines);
  }
  micro<R>(x, x_stride, w, n_pairs, acc, ahead, lines);
}

// The vdpbf16ps micro-kernel over every block: y [M, N] = x [M, 2 K2] W^T (+ b).
void vdp_multiply(const c10::BFloat16* x, int64_t M, int64_t K2, const c10::BFloat16* w, int64_t N, const float* b,
                  c10::BFloat16* yp) {
  const int64_t K = 2 * K2;
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto* wp = reinterpret_cast<const __m512bh*>(w);
  const __m512bh* w_end = wp + N / kCols * K2 * 4;
  // Rows of x are taken a tile at a time, each tile against every block of this thread's
  // columns, so that the tile is read from L2 (many rows: a prefill chunk) and a block's
  // weights once per tile (few rows: a decode step has one tile).
  const int64_t row_tile = std::max<int64_t>(kRows, kRowTileBytes / (2 * K) / kRows * kRows);
  at::parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(M, row_tile) * kCols);
    for (int64_t t0 = 0; t0 < M; t0 += row_tile) {
      const int64_t tile_rows = std::min(row_tile, M - t0);
      // Rows are dealt out evenly (13 rows: 5, 4, 4, not 6, 6, 1): a group of few rows has
      // too few independent sums to hide vdpbf16ps's latency, so it costs nearly a full one.
      const int64_t groups = (tile_rows + kRows - 1) / kRows;
      const int64_t base = tile_rows / groups, extra = tile_rows % groups;
      const int64_t pass_pairs = groups <= kFewGroups ? kFewGroupPairs : kKeyPairs;
      for (int64_t nb = begin; nb < end; ++nb) {
        const __m512bh* block = wp + nb * K2 * 4;  // 4 vectors a pair
        std::fill(acc.begin(), acc.begin() + tile_rows * kCols, 0.0f);
        for (int64_t p0 = 0; p0 < K2; p0 += pass_pairs) {
          const int64_t n_pairs = std::min(pass_pairs, K2 - p0);
          // The weights after this pass (the next pass, or the next block: they follow in
          // memory, up to the weight's end), asked for into L2 while this pass computes, a
          // share in each group of rows. A vector is a line: 4 lines a pair.
          const __m512bh* next = block + 4 * (p0 + n_pairs);
          const int64_t lines = std::min<int64_t>(4 * pass_pairs, w_end - next);
          const int64_t share = (lines + groups - 1) / groups;
          for (int64_t g = 0, m0 = 0; g < groups; ++g) {
            const int64_t rows = base + (g < extra ? 1 : 0);
            micro_any(rows, xp + (t0 + m0) * K2 + p0, K2, block + 4 * p0, n_pairs, &acc[m0 * kCols],
                      next + std::min(lines, g * share), std::max<int64_t>(0, std::min(share, lines - g * share)));
            m0 += rows;
          }
        }
        for (int64_t m = 0; m < tile_rows; ++m)
          for (int64_t j = 0; j < 4; ++j) {
            __m512 v = _mm512_loadu_ps(&acc[m * kCols + 16 * j]);
            if (b != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(b + nb * kCols + 16 * j));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (t0 + m) * N + nb * kCols + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
  });
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
namespace amx {

constexpr int64_t kPairs = 16;  // pairs of k a tile holds
constexpr int64_t kTileRows = 16;  // rows of x (or of sums) a tile holds
constexpr int64_t kPairBytes = kCols * 2 * 2;  // one pair of k of a block: 64 columns' two bf16

// Tiles 0-3: the sums of rows a (0, 1) and b (2, 3) by columns c (0, 2) and d (1, 3);
// 4, 5: rows a and b of x; 6, 7: the weights of columns c and d. rows_b 0: no rows b.
inline void configure(int64_t rows_a, int64_t rows_b) {
  travelator::AmxTileConfig cfg;
  const int64_t rows[8] = {rows_a, rows_a, rows_b, rows_b, rows_a, rows_b, kPairs, kPairs};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(std::max<int64_t>(rows[t], 1));
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// A finished pass's sums (its 32 columns of up to 32 rows), written out as bf16 while the
// next pass computes: written between passes, the tiles idled while they were converted.
// Each row's 32 columns are one whole 64-byte line of y, stored non-temporally: a regular
// store first reads the line in, which slowed the whole kernel by more than writing y costs.
struct PendingSums {
  const float* c = nullptr;  // tile t's 16 x 16 sums at c + 256 t (tiles 0-3 as in configure)
  c10::BFloat16* y = nullptr;
  int64_t n = 0;  // y's columns
  const float* b = nullptr;
  int64_t col = 0, row0 = 0;  // columns col .. col + 31 of rows a (from row0) and b (16 further)
  int64_t rows_a = 0, rows = 0;  // rows is rows_a plus rows b's count

  // Rows [first, stop) of the pass's rows a, then b.
  void write(int64_t first, int64_t stop) const {
    for (int64_t i = first; i < stop; ++i) {
      const int64_t half = i < rows_a ? 0 : 1, r = i - half * rows_a;
      __m512 lo = _mm512_loadu_ps(c + 512 * half + 16 * r), hi = _mm512_loadu_ps(c + 512 * half + 256 + 16 * r);
      if (b != nullptr) lo = _mm512_add_ps(lo, _mm512_loadu_ps(b + col)), hi = _mm512_add_ps(hi, _mm512_loadu_ps(b + col + 16));
      auto* line = reinterpret_cast<__m512i*>(y + (row0 + kTileRows * half + r) * n + col);
      _mm512_stream_si512(line, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

// The sums over every k of x's rows a (from xa) and, kTwo, b (16 rows further) by the
// block's columns 16 j .. 16 j + 31, stored to c: tile t's 16 x 16 floats at c + 256 t.
// ahead, lines: lines of weights to ask for into L2 meanwhile; done: the previous pass's
// sums to write out meanwhile; both spread over k.
template <bool kTwo>
inline void pass(const c10::BFloat16* xa, int64_t x_row_bytes, const c10::BFloat16* block, int64_t K2, int64_t j,
                 float* c, const char* ahead, int64_t lines, const PendingSums& done) {
  const int64_t per_step = (lines * kPairs + K2 - 1) / K2;
  const int64_t rows_per_step = (done.rows * kPairs + K2 - 1) / K2;
  const c10::BFloat16* xb = xa + kTileRows * (x_row_bytes / 2);
  const c10::BFloat16* wc = block + 32 * j;  // column tile j: 16 columns' pairs into each pair's 64
  const c10::BFloat16* wd = wc + 32;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0, step = 0; p < K2; p += kPairs, ++step) {
    ask_into_l2(ahead, step * per_step, std::min(lines, (step + 1) * per_step));
    _tile_loadd(4, xa + 2 * p, x_row_bytes);
    _tile_loadd(6, wc + p * 2 * kCols, kPairBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, wd + p * 2 * kCols, kPairBytes);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, xb + 2 * p, x_row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    done.write(std::min(done.rows, step * rows_per_step), std::min(done.rows, (step + 1) * rows_per_step));
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (kTwo) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// y [M, N] = x [M, 2 K2] W^T (+ b), K2 a multiple of kPairs, y 64-byte aligned. Blocks of
// 64 columns are split over threads; rows of x are taken a tile at a time (kept in L2),
// each tile against every block of the thread's, 32 rows and 32 columns a pass. A block's
// first two passes (its two pairs of column tiles) read it from memory, half each, and its
// passes over more rows from L2, so the passes over a block ask for the block the thread
// takes next, a share each: memory streams while the tiles compute, where otherwise the
// two took turns.
void multiply(const c10::BFloat16* x, int64_t M, int64_t K2, const c10::BFloat16* w, int64_t N, const float* b,
              c10::BFloat16* y) {
  const int64_t K = 2 * K2, pass_rows = 2 * kTileRows;
  const int64_t tile_bytes = std::min(kTileRowTileBytes, kTileL2Bytes - 2 * K2 * kPairBytes);
  const int64_t row_tile = std::max<int64_t>(pass_rows, tile_bytes / (2 * K) / pass_rows * pass_rows);
  at::parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[2][4 * 256];  // a pass's sums, and the previous pass's being written out
    PendingSums done{nullptr, y, N, b};
    int64_t configured_a = -1, configured_b = -1, turn = 0;
    for (int64_t t0 = 0; t0 < M; t0 += row_tile) {
      const int64_t t1 = std::min(M, t0 + row_tile);
      const int64_t passes = 2 * ((t1 - t0 + pass_rows - 1) / pass_rows);
      for (int64_t nb = begin; nb < end; ++nb) {
        const c10::BFloat16* block = w + nb * K2 * 2 * kCols;
        const int64_t next = nb + 1 < end ? nb + 1 : t1 < M ? begin : -1;
        const char* ahead = reinterpret_cast<const char*>(w + std::max<int64_t>(next, 0) * K2 * 2 * kCols);
        const int64_t block_lines = next < 0 ? 0 : K2 * kPairBytes / 64;
        const int64_t share = (block_lines + passes - 1) / passes;
        int64_t asked = 0;
        for (int64_t m0 = t0; m0 < t1; m0 += pass_rows) {
          const int64_t rows_a = std::min(kTileRows, t1 - m0);
          const int64_t rows_b = std::clamp<int64_t>(t1 - m0 - kTileRows, 0, kTileRows);
          if (rows_a != configured_a || rows_b != configured_b) {
            configure(rows_a, rows_b);
            configured_a = rows_a, configured_b = rows_b;
          }
          for (int64_t j = 0; j < 4; j += 2, turn ^= 1) {
            const int64_t lines = std::min(share, block_lines - asked);
            if (rows_b > 0) pass<true>(x + m0 * K, 2 * K, block, K2, j, c[turn], ahead + 64 * asked, lines, done);
            else pass<false>(x + m0 * K, 2 * K, block, K2, j, c[turn], ahead + 64 * asked, lines, done);
            asked += lines;
            done.c = c[turn], done.col = nb * kCols + 16 * j, done.row0 = m0;
            done.rows_a = rows_a, done.rows = rows_a + rows_b;
          }
        }
      }
    }
    done.write(0, done.rows);
    _mm_sfence();  // the non-temporal stores are visible, in order, before the caller reads y
    if (configured_a >= 0) _tile_release();
  });
}

}  // namespace amx
#endif

// The multiple of k's length from which the AMX micro-kernel takes a weight (0: it is not
// built here, or the kernel may not use the tiles); model/native_linear.py lays out for
// blocked_linear only the weights it takes, on CPUs with AMX.
int64_t blocked_linear_amx_k_multiple() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  return travelator::amx_tiles_permitted() ? 2 * amx::kPairs : 0;
#else
  return 0;
#endif
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "blocked_linear: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(2) == kCols &&
                  w.size(3) == 2,
              "blocked_linear: w must be a blocked bf16 weight [N / 64, K / 2, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = w.size(1), N = w.size(0) * kCols;
  TORCH_CHECK(K == 2 * K2, "blocked_linear: x has ", K, " columns, the weight ", 2 * K2);
  TORCH_CHECK(K2 > 0, "blocked_linear: no columns in x");
  const float* b = nullptr;
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "blocked_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (K2 % amx::kPairs == 0 && travelator::amx_tiles_permitted()) {
    TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(yp) % 64 == 0, "blocked_linear: y is not 64-byte aligned");
    amx::multiply(xp, M, K2, wp, N, b, yp);
    return y;
  }
#endif
  vdp_multiply(xp, M, K2, wp, N, b, yp);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  // x [M, K] bf16, w from blocked_linear_weight (model/native_linear.py), bias [N] or None.
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("blocked_linear", c10::DispatchKey::CPU, &blocked_linear);
  m.def("blocked_linear_amx_k_multiple() -> int", &blocked_linear_amx_k_multiple);
}
#endif
