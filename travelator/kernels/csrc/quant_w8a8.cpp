// y = x W^T for many rows of x against int8 weights, both operands in int8 (W8A8): batches
// and prefill chunks, where the weight-only kernel (quant_linear.cpp) re-reads each weight
// once per row of x and the dequantizing path pays a float GEMM on widened weights.
//
// x is quantized per row (symmetric, per token): xs = max |x[m, :]| / 127,
// xq = round(x * (127 / max |x|)) in float32, rounded to nearest even, clamped to +-127. A row
// holding a NaN or an infinity gets a NaN scale (its outputs are NaN, as a float product's
// would be); an all-zero row gets scale 0. Each row's integer form depends on that row only.
// The weights are the Int8Weight's own codes, as packed (u = q + 128, model/quant.py): no
// repacking, the kernel reads the layout as it is.
//
// The int32 sum acc[m, n] = sum_k xq[m, k] q[n, k] is exact: |acc| <= K * 127 * 127, below
// 2^31 for K up to 133,144 (checked). Then, in float32,
//   y[m, n] = (float(acc) * xs[m]) * scale[n] (+ bias[n]),
// rounded once to x's dtype. The integer sums per instruction set:
//   AVX2 (no VNNI): vpmaddubsw multiplies unsigned bytes by signed bytes and adds pairs into
//     int16 with saturation. It gets |q| (0..127: q is never -128) as the unsigned operand and
//     xq * sign(q) (vpsignb; xq is never -128 either) as the signed one: each product is xq q
//     exactly and a pair is at most 2 * 127 * 127 = 32258 < 32767, so nothing saturates;
//     vpmaddwd by 1 widens the pairs into int32. |q| is taken once a weight vector, for all
//     the rows, so a row costs one broadcast of x a quad (|xq| and xq's sign would take two).
//   AVX512-VNNI (256-bit, with VL) or AVX-VNNI: vpdpbusd on u (unsigned) and xq (signed),
//     4 products summed into int32 without saturation: the sum is acc + 128 sum_k xq, and
//     128 sum_k xq of the row is taken off before the float steps.
// So every instruction set gives the same int32 sums and the same float steps: a row's bits
// do not depend on the CPU's path, on the other rows of x, or on the split over threads.
//
// Microkernel: kRows rows of x times 16 output columns (two vectors of 8 int32 lanes, one
// lane per column, the lane's 4 bytes being 4 consecutive inputs: the packed layout's), so
// each weight vector loaded is used for kRows rows; 8 accumulators, 2 weight vectors, their
// |q| (AVX2), the two constants and a broadcast of x fill AVX2's 16 registers. Work items are
// (tile of 64 columns, chunk of rows), tile-major, over OpenMP threads; within an item the
// tile (K * 64 bytes) stays in L2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "quant_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRAVELATOR_W8A8 1
#endif

namespace {

#if defined(TRAVELATOR_W8A8)
using namespace travelator::quant;

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

constexpr int64_t kMaxRows = 4;        // rows of x per microkernel
constexpr int64_t kChunkRows = 64;     // rows of x per work item
constexpr int64_t kMaxK = 131072;      // K * 127 * 127 stays below 2^31
constexpr int64_t kPanelCols = 16;     // output columns per microkernel: 2 vectors of 8

// x's integer form: xq [M, K_padded] (padding 0), per row its float scale and 128 * sum xq
// (the VNNI paths' compensation).
struct QuantizedX {
  at::Tensor q;
  std::vector<float> scale;
  std::vector<int32_t> offset;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // a bf16 is the top half of a float32: exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float max8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

inline int32_t sum8(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

// xq of one input: round to nearest even (nearbyint in the default mode, as the vectors'
// _MM_FROUND_TO_NEAREST_INT and torch.round), clamped.
inline int32_t quantize_one(float v, float inv) {
  return static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(v * inv))));
}

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t K, int8_t* q, float& scale, int32_t& offset) {
  const int64_t K8 = K / 8 * 8;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  __m256 mx = zero, bad = zero;
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v = load8(x + k);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_NEQ_UQ));  // v - v: NaN if not finite
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_bit, v));
  }
  float top = max8(mx);
  bool finite = !_mm256_movemask_ps(bad);
  for (int64_t k = K8; k < K; ++k) {
    const float v = static_cast<float>(x[k]);
    finite = finite && std::isfinite(v);
    top = std::max(top, std::fabs(v));
  }
  if (!finite || !(top > 0.0f)) {  // a NaN scale makes the row NaN; an all-zero row: scale 0
    if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, K);
    return;
  }
  const float inv = 127.0f / top;
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(x + k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    sum = _mm256_add_epi32(sum, i);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    const __m128i b8 = _mm_packs_epi16(w16, w16);  // in order, no value past +-127 to saturate
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), b8);
  }
  int32_t total = sum8(sum);
  for (int64_t k = K8; k < K; ++k) {
    const int32_t v = quantize_one(static_cast<float>(x[k]), inv);
    q[k] = static_cast<int8_t>(v);
    total += v;
  }
  scale = top / 127.0f, offset = 128 * total;
}

template <typename scalar_t>
QuantizedX quantize_x(const at::Tensor& x, int64_t K_padded) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedX r;
  r.q = at::empty({M, K_padded}, x.options().dtype(at::kChar));
  r.scale.assign(M, 0.0f), r.offset.assign(M, 0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  int8_t* q = r.q.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K, K, q + m * K_padded, r.scale[m], r.offset[m]);
      std::memset(q + m * K_padded + K, 0, K_padded - K);
    }
  });
  return r;
}

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc[m][v]: the int32 sums of rows m0.. of x against the panel's 16 columns (lane = column),
// over all K_padded inputs; the VNNI paths' sums still hold the + 128 sum xq.
template <int64_t MR>
void microkernel(const int8_t* xq, int64_t K, const uint8_t* w, __m256i (&out)[MR][2]) {
  __m256i acc[MR][2];  // local: the caller's array would be stored at every step
  for (int64_t m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  [[maybe_unused]] const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 4) {
    const uint8_t* wk = w + k * kTileRows;  // the quad's 256 bytes; the panel's 64 of them
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32));
    if constexpr (kVnni) {
      for (int64_t m = 0; m < MR; ++m) {
        const __m256i xs = bcast4(xq + m * K + k);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        acc[m][0] = _mm256_dpbusd_epi32(acc[m][0], w0, xs);
        acc[m][1] = _mm256_dpbusd_epi32(acc[m][1], w1, xs);
#elif defined(__AVXVNNI__)
        acc[m][0] = _mm256_dpbusd_avx_epi32(acc[m][0], w0, xs);
        acc[m][1] = _mm256_dpbusd_avx_epi32(acc[m][1], w1, xs);
#endif
      }
    } else {
      w0 = _mm256_xor_si256(w0, flip), w1 = _mm256_xor_si256(w1, flip);  // u - 128 = q, signed
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int64_t m = 0; m < MR; ++m) {
        const __m256i xs = bcast4(xq + m * K + k);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xs, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xs, w1));
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(p0, ones));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(p1, ones));
      }
    }
  }
  for (int64_t m = 0; m < MR; ++m) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}

struct Operands {
  const QuantizedX* x;
  const uint8_t* w;
  const float* scales;
  const float* bias;  // nullptr: none
  int64_t K_padded, N;
};

// Rows m0..m0+MR-1 against the panel starting at column n0: the sums, then the float steps.
template <int64_t MR, typename scalar_t>
void panel(const Operands& o, int64_t m0, int64_t n0, scalar_t* y) {
  const int64_t K = o.K_padded, tile = n0 / kTileRows;
  const uint8_t* w = o.w + tile * K * kTileRows + (n0 % kTileRows) * 4;  // a column's 4 bytes
  __m256i acc[MR][2];
  microkernel<MR>(o.x->q.data_ptr<int8_t>() + m0 * K, K, w, acc);
  const int64_t cols = std::min(kPanelCols, o.N - n0);
  for (int64_t m = 0; m < MR; ++m) {
    alignas(32) float out[kPanelCols];
    const __m256 xs = _mm256_set1_ps(o.x->scale[m0 + m]);
    const __m256i offset = _mm256_set1_epi32(kVnni ? o.x->offset[m0 + m] : 0);
    for (int v = 0; v < 2; ++v) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][v], offset));
      _mm256_store_ps(out + 8 * v, _mm256_mul_ps(_mm256_mul_ps(a, xs), _mm256_loadu_ps(o.scales + n0 + 8 * v)));
    }
    scalar_t* row = y + (m0 + m) * o.N + n0;
    for (int64_t c = 0; c < cols; ++c)
      row[c] = static_cast<scalar_t>(o.bias ? out[c] + o.bias[n0 + c] : out[c]);
  }
}

template <typename scalar_t>
void run_item(const Operands& o, int64_t tile, int64_t m0, int64_t m1, scalar_t* y) {
  const int64_t n_end = std::min(o.N, (tile + 1) * kTileRows);
  int64_t m = m0;
  for (; m + kMaxRows <= m1; m += kMaxRows)
    for (int64_t n0 = tile * kTileRows; n0 < n_end; n0 += kPanelCols) panel<kMaxRows>(o, m, n0, y);
  for (int64_t n0 = tile * kTileRows; n0 < n_end; n0 += kPanelCols) {
    switch (m1 - m) {
      case 3: panel<3>(o, m, n0, y); break;
      case 2: panel<2>(o, m, n0, y); break;
      case 1: panel<1>(o, m, n0, y); break;
      default: break;
    }
  }
}

// x [M, K] bf16 or float32; packed uint8 [N_padded / 64, K_padded / 4, 4, 64] (Int8Weight's,
// K_padded: K rounded up to 128); scales float32 [N_padded]; bias float32 [N] or none.
// Returns [M, N] in x's dtype.
at::Tensor quant_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              x.is_contiguous(), "quant_linear_w8a8: x must be contiguous bf16 or float32 [M, K]");
  check_packed(packed, "quant_linear_w8a8");
  const int64_t n_tiles = packed.size(0), K_padded = packed.size(1) * 4, K = x.size(1), M = x.size(0);
  TORCH_CHECK(K_padded % kInt8Block == 0 && K <= K_padded && K_padded - K < kInt8Block, "quant_linear_w8a8: K does not match");
  TORCH_CHECK(K_padded <= kMaxK, "quant_linear_w8a8: K past ", kMaxK, " could overflow the int32 sums");
  TORCH_CHECK(N <= n_tiles * kTileRows && N > (n_tiles - 1) * kTileRows, "quant_linear_w8a8: N does not match");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n_tiles * kTileRows,
              "quant_linear_w8a8: scales must be float32 [N_padded]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear_w8a8: bias must be float32 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  with_float_type(x.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const QuantizedX xq = quantize_x<scalar_t>(x, K_padded);
    const Operands o{&xq, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                     has_bias ? bias->data_ptr<float>() : nullptr, K_padded, N};
    const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Items are tile-major: with tiles enough for every thread, pieces of whole tiles, so that
    // a tile's rows of x run on one thread and the tile is read into one L2.
    const bool whole_tiles = n_tiles >= 8 * at::get_num_threads();
    travelator::dynamic_split(n_tiles * chunks, whole_tiles ? chunks : 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t tile = i / chunks, m0 = (i % chunks) * kChunkRows;
        run_item(o, tile, m0, std::min(M, m0 + kChunkRows), yp);
      }
    });
    return 0;
  });
  return y;
}
#endif  // TRAVELATOR_W8A8

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
#if defined(TRAVELATOR_W8A8)
  m.def("quant_linear_w8a8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int N) -> Tensor");
  m.impl("quant_linear_w8a8", c10::DispatchKey::CPU, &quant_linear_w8a8);
#endif
}
