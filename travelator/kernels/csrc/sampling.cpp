// The sampler's kernels: the greedy argmax, the exponential race that draws from softmax,
// and structured outputs' token bitmask.

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "row_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace travelator::rows;
// Index of each row's largest value, as torch.argmax(dim=-1): the first maximum, and the
// first NaN if a row has one. One pass for the maximum, one for its first position;
// vectorised on AVX-512 and AVX2 (torch's own arg-reduction is scalar-speed here). bf16 rows
// are widened exactly, so their argmax is that of their float32 copy, without making one.
#if defined(__AVX512F__)
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// The row's largest value, and whether it holds a NaN (then the value is not used).
template <typename T>
std::pair<float, bool> row_max(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(best);
  __mmask16 nan_lanes = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16f(x + i);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  has_nan = nan_lanes != 0;
  if (!has_nan) best = _mm512_reduce_max_ps(vmax);
#elif defined(TRAVELATOR_VEC8)
  __m256 vmax = _mm256_set1_ps(best), nan_lanes = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = travelator::vec8::load(x + i);
    nan_lanes = _mm256_or_ps(nan_lanes, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  has_nan = _mm256_movemask_ps(nan_lanes) != 0;
  if (!has_nan) best = travelator::vec8::max(vmax);
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    has_nan |= v != v;
    best = std::max(best, v);
  }
  return {best, has_nan};
}

// The first index holding `best` (the first NaN where the row has one).
template <typename T>
int64_t first_index_of(const T* x, int64_t n, float best, bool has_nan) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16f(x + j);
    const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(TRAVELATOR_VEC8)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = travelator::vec8::load(x + j);
    const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    if (has_nan ? v != v : v == best) return j;
  }
  return 0;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  const auto [best, has_nan] = row_max(x, n);
  return first_index_of(x, n, best, has_nan);
}

template <typename T>
void argmax_all_rows(const at::Tensor& x, at::Tensor& out) {
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax_rows: expected a contiguous float32 or bfloat16 [B, V] tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) argmax_all_rows<float>(x, out);
  else argmax_all_rows<c10::BFloat16>(x, out);
  return out;
}

// Sampling by exponential race: row r draws argmax_j (scores[r, j] - log E_j) with
// E_j = -log U_j, U_j uniform from a counter-based generator (splitmix64 of seeds[r] and j):
// a draw from softmax(scores[r]) that depends only on the row's seed, so the same whatever
// the batch and however the work is split over threads. -inf scores (filtered tokens) never win.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

at::Tensor exponential_race(const at::Tensor& scores, const at::Tensor& seeds) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              "exponential_race: contiguous float32 [B, V] scores");
  TORCH_CHECK(seeds.dim() == 1 && seeds.is_contiguous() && seeds.scalar_type() == at::kLong &&
                  seeds.size(0) == scores.size(0), "exponential_race: int64 [B] seeds");
  const int64_t vocab = scores.size(1);
  at::Tensor out = at::empty({scores.size(0)}, seeds.options());
  const float* sp = scores.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, scores.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = sp + r * vocab;
      const uint64_t base = static_cast<uint64_t>(seed[r]) * 0xD1B54A32D192ED03ull;
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = -1;
      for (int64_t j = 0; j < vocab; ++j) {
        const float x = row[j];
        if (!(x > -std::numeric_limits<float>::infinity())) continue;  // filtered (or NaN)
        const uint64_t h = splitmix64(base + static_cast<uint64_t>(j));
        // (0, 1): the top 24-bit value plus a half rounds to 1.0 in float32, whose noise would
        // make its token win whatever its score; it takes the largest float below 1 instead.
        const float u = std::min((static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f), 0x1.fffffep-1f);
        const float s = x - std::log(-std::log(u));
        if (s > best) {
          best = s;
          arg = j;
        }
      }
      op[r] = arg < 0 ? 0 : arg;
    }
  });
  return out;
}

// Structured outputs: logits[rows[k], j] = -inf where bit j of masks[k] is 0 (bit j%32 of
// word j/32: llguidance's token bitmask). One pass over the masked rows only.
template <typename T>
void mask_rows(T* logits, int64_t vocab, const int32_t* masks, int64_t words, const int64_t* rows,
               int64_t n) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      T* row = logits + rows[k] * vocab;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks + k * words);
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t word = bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t stop = std::min<int64_t>(32, vocab - w * 32);
        for (int64_t j = 0; j < stop; ++j)
          if (!((word >> j) & 1u)) row[w * 32 + j] = neg_inf;
      }
    }
  });
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& masks, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "apply_token_bitmask_: contiguous [B, V] logits");
  TORCH_CHECK(masks.dim() == 2 && masks.is_contiguous() && masks.scalar_type() == at::kInt,
              "apply_token_bitmask_: contiguous int32 [K, words] masks");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.size(0) == masks.size(0), "apply_token_bitmask_: int64 [K] rows, one per mask");
  TORCH_CHECK(masks.size(1) * 32 >= logits.size(1), "apply_token_bitmask_: masks narrower than the vocabulary");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < rows.size(0); ++k)
    TORCH_CHECK(r[k] >= 0 && r[k] < logits.size(0), "apply_token_bitmask_: row out of range");
  switch (logits.scalar_type()) {
    case at::kFloat: return mask_rows(logits.data_ptr<float>(), logits.size(1), masks.data_ptr<int32_t>(), masks.size(1), r, rows.size(0));
    case at::kBFloat16: return mask_rows(logits.data_ptr<c10::BFloat16>(), logits.size(1), masks.data_ptr<int32_t>(), masks.size(1), r, rows.size(0));
    case at::kHalf: return mask_rows(logits.data_ptr<c10::Half>(), logits.size(1), masks.data_ptr<int32_t>(), masks.size(1), r, rows.size(0));
    default: TORCH_CHECK(false, "apply_token_bitmask_: unsupported dtype ", logits.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("exponential_race(Tensor scores, Tensor seeds) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor masks, Tensor rows) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.impl("exponential_race", c10::DispatchKey::CPU, &exponential_race);
  m.impl("apply_token_bitmask_", c10::DispatchKey::CPU, &apply_token_bitmask_);
}
