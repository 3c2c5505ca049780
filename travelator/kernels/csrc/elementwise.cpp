// Fused per-token operations of the Llama block: RMSNorm (optionally adding the
// residual first), SiLU(gate) * up, and rotary embeddings applied in place.
//
// Each reproduces the rounding of the pure-torch layers it replaces (compute in float,
// round to the model dtype where torch does), in one pass over memory instead of three
// to six. Every row is computed on its own, in a fixed order, so results never depend
// on the number of rows in the step.

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
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// Sum of squares with kLanes partial sums combined in a fixed tree: vectorisable
// without reassociation, identical for a row whatever the batch.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      part[l] += v * v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    part[l] += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

#if defined(TRAVELATOR_VEC16) || defined(TRAVELATOR_VEC8)
// float32 and bf16 take the explicit AVX-512 (or AVX2) forms below (the compiler does not
// vectorise the scalar loops' bf16 conversions); other types the scalar loops.
template <typename T>
constexpr bool kVectorised = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#endif
#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;
#endif

#if defined(TRAVELATOR_VEC16)
namespace v16 = travelator::vec16;

// sum_squares with the kLanes partial sums in one register, combined by the same tree.
template <typename T>
float sum_squares_vec(const T* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512 v = v16::load(x + i, v16::lanes(n - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float part[kLanes];
  _mm512_storeu_ps(part, acc);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}
#endif

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(sum_squares_vec(x, n) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = v16::lanes(n - i);
      const __m512 normed = v16::round_as(T{}, _mm512_mul_ps(v16::load(x + i, m), r));
      v16::store(out + i, _mm512_mul_ps(v16::load(weight + i, m), normed), m);
    }
    return;
  }
#endif
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(round_to<T>(static_cast<float>(x[i]) * r));
    out[i] = round_to<T>(static_cast<float>(weight[i]) * normed);
  }
}

// row += d, rounded to T as torch's add rounds.
template <typename T>
void add_row(T* row, const T* d, int64_t n) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = v16::lanes(n - i);
      v16::store(row + i, _mm512_add_ps(v16::load(row + i, m), v16::load(d + i, m)), m);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) row[i] = round_to<T>(static_cast<float>(row[i]) + static_cast<float>(d[i]));
}

template <typename T>
void rms_norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xp + r * n;
      if (dp) add_row(row, dp + r * n, n);  // the residual stream += delta
      norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": expected a contiguous [T, H] tensor");
}

template <typename F>
void dispatch_float_types(const at::Tensor& x, const char* what, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", x.scalar_type());
  }
}

// weight * round(x * rsqrt(mean(x^2) + eps)), as travelator.model.layers.RMSNorm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "rms_norm: bad weight");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor xm = x;
  dispatch_float_types(x, "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(xm, nullptr, weight, out, eps);
  });
  return out;
}

// x += delta (in place, the residual stream), then returns rms_norm(x).
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(delta, "add_rms_norm_");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "add_rms_norm_: bad delta");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "add_rms_norm_: bad weight");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x, "add_rms_norm_", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, &delta, weight, out, eps);
  });
  return out;
}

// In place over every head of x [T, H, D] (rows of D contiguous, any row strides: a view of
// the QKV projection's output): each head's D numbers normalised as rms_norm normalises a row
// (Qwen3's per-head q/k norm).
void head_rms_norm_(at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "head_rms_norm_: expected [T, H, D] with contiguous heads");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(2),
              "head_rms_norm_: bad weight");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  dispatch_float_types(x, "head_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    T* base = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        T* head = base + (i / heads) * token_stride + (i % heads) * head_stride;
        norm_row(head, wp, head, d, static_cast<float>(eps));  // each element read before it is written
      }
    });
  });
}

// act(gate) = gate * sigmoid(a) with a = gate (SiLU) or a = 2 sqrt(2/pi) (gate + 0.044715 gate^3)
// (tanh-approximated GELU: 0.5 x (1 + tanh(z)) is x sigmoid(2 z)), so one loop serves both.
constexpr float kGeluScale = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

inline float sigmoid_arg(float x, bool gelu) { return gelu ? kGeluScale * (x + kGeluCubic * x * x * x) : x; }

template <typename T>
void gated_act_mul_impl(const at::Tensor& gate_up, at::Tensor& out, bool gelu) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* in = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
#if defined(TRAVELATOR_VEC16)
      if constexpr (kVectorised<T>) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t i = 0; i < inter; i += kLanes) {
          const __mmask16 m = v16::lanes(inter - i);
          const __m512 x = v16::load(g + i, m);
          const __m512 arg = gelu ? _mm512_mul_ps(_mm512_set1_ps(kGeluScale),
                                                  _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluCubic), x),
                                                                  _mm512_mul_ps(x, x), x))
                                  : x;
          const __m512 e = v16::exp(_mm512_sub_ps(_mm512_setzero_ps(), arg));
          const __m512 silu = v16::round_as(T{}, _mm512_mul_ps(x, v16::reciprocal(_mm512_add_ps(one, e))));
          v16::store(o + i, _mm512_mul_ps(silu, v16::load(u + i, m)), m);
        }
        continue;
      }
#endif
      int64_t i = 0;
#if defined(TRAVELATOR_VEC8)
      // 8 lanes at a time, then the row's tail by the scalar steps below.
      if constexpr (kVectorised<T>) {
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = v8::load(g + i);
          const __m256 arg = gelu ? _mm256_mul_ps(_mm256_set1_ps(kGeluScale),
                                                  _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluCubic), x),
                                                                  _mm256_mul_ps(x, x), x))
                                  : x;
          const __m256 e = v8::exp(_mm256_sub_ps(_mm256_setzero_ps(), arg));
          const __m256 silu = v8::round_as(T{}, _mm256_div_ps(x, _mm256_add_ps(one, e)));
          v8::store(o + i, _mm256_mul_ps(silu, v8::load(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        const float silu = static_cast<float>(round_to<T>(x / (1.0f + travelator::exp_approx(-sigmoid_arg(x, gelu)))));
        o[i] = round_to<T>(silu * static_cast<float>(u[i]));
      }
    }
  });
}

// [T, 2I] (gate then up) -> [T, I]: round(silu(gate)) * up, as layers.silu_and_mul.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd width");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_types(gate_up, "silu_and_mul", [&](auto tag) { gated_act_mul_impl<decltype(tag)>(gate_up, out, false); });
  return out;
}

// [T, 2I] (gate then up) -> [T, I]: round(gelu_tanh(gate)) * up, as layers.gelu_tanh_and_mul (GeGLU).
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gelu_tanh_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gelu_tanh_and_mul: odd width");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_types(gate_up, "gelu_tanh_and_mul", [&](auto tag) { gated_act_mul_impl<decltype(tag)>(gate_up, out, true); });
  return out;
}

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, int64_t half,
               const int64_t* positions, const float* cos, const float* sin) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + t * row_stride + h * head_dim;
        T* b = a + half;
#if defined(TRAVELATOR_VEC16)
        if constexpr (kVectorised<T>) {
          for (int64_t i = 0; i < half; i += kLanes) {
            const __mmask16 m = v16::lanes(half - i);
            const __m512 x1 = v16::load(a + i, m), x2 = v16::load(b + i, m);
            const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
            v16::store(a + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), m);
            v16::store(b + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), m);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(b[i]);
          a[i] = round_to<T>(x1 * c[i] - x2 * s[i]);
          b[i] = round_to<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

bool heads_contiguous(const at::Tensor& x) {
  return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// Rotates the two halves of the first R numbers of every head of q [T, H, D] and k [T, KVH, D]
// in place, by the angles of each token's position (cos, sin: [max_positions, R/2] float32;
// R < D: partial rotary, the rest of a head passes through). q and k may be row-strided views
// of one fused QKV tensor.
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  TORCH_CHECK(heads_contiguous(q) && heads_contiguous(k), "rope_: q, k must be [T, H, D] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.size(2) == k.size(2) && q.size(0) == k.size(0), "rope_: q and k do not match");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0), "rope_: bad positions");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              sin.sizes() == cos.sizes() && cos.size(1) * 2 <= q.size(2), "rope_: bad cos/sin tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_: position ", pos[t], " out of range");
  dispatch_float_types(q, "rope_", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = q.size(2), half = cos.size(1);
    rope_rows(q.data_ptr<T>(), q.size(0), q.stride(0), q.size(1), d, half, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
    rope_rows(k.data_ptr<T>(), k.size(0), k.stride(0), k.size(1), d, half, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// One head's vector as an int8 cache row: codes = round(x * (127 / max|x|)), then the float32
// scale max|x| / 127; a row with a NaN or an infinity gets codes 0 and a NaN scale, a row
// whose 127 / max|x| overflows (all zeros, or below ~4e-37) codes 0. The
// same float steps as model/kv_cache.py's quantize_rows, so both give the same bytes.
template <typename T>
void quantize_kv_row(const T* x, int64_t d, int8_t* out) {
#if defined(TRAVELATOR_VEC16)
  if constexpr (kVectorised<T>) {
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (int64_t i = 0; i < d; i += kLanes) {
      const __mmask16 m = v16::lanes(d - i);
      const __m512 v = v16::load(x + i, m);
      // v - v is 0 for a finite v, NaN for an infinity or a NaN.
      not_finite |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    const bool finite = not_finite == 0;
    const float amax = finite ? _mm512_reduce_max_ps(vmax) : 0.0f;
    const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inv_scalar = 127.0f / amax;  // all zeros, or a max below ~4e-37: not finite
    const __m512 inv = _mm512_set1_ps(finite && std::isfinite(inv_scalar) ? inv_scalar : 0.0f);
    for (int64_t i = 0; i < d; i += kLanes) {
      const __mmask16 m = v16::lanes(d - i);
      // Converted with the default rounding, to nearest even: std::nearbyint's.
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v16::load(x + i, m), inv));
      _mm512_mask_cvtepi32_storeu_epi8(out + i, m, finite ? codes : _mm512_setzero_si512());
    }
    std::memcpy(out + d, &scale, sizeof(scale));
    return;
  }
#endif
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float inv_scalar = 127.0f / amax;  // all zeros, or a max below ~4e-37: not finite
  const float inv = finite && std::isfinite(inv_scalar) ? inv_scalar : 0.0f;
  for (int64_t i = 0; i < d; ++i)
    out[i] = finite ? static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inv)) : 0;
  std::memcpy(out + d, &scale, sizeof(scale));
}

// The new tokens' keys and values into their cache slots: k, v [T, KVH, D] (row-strided
// views of the fused QKV tensor are fine), caches [blocks, KVH, block_size, row], slots [T]
// long (slot = block * block_size + position). A cache of k's dtype takes one copy per
// token and head (index_copy_ took two passes and a per-element index check: about 40 us
// for 64 tokens here, against 5); an int8 cache (row = D + 4) takes each head quantized.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  TORCH_CHECK(heads_contiguous(k) && heads_contiguous(v) && k.sizes() == v.sizes(), "write_kv_: k, v must be [T, KVH, D] with contiguous heads");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "write_kv_: k and v dtypes differ");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t heads = k.size(1), d = k.size(2), row = int8 ? d + 4 : d;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(1) == heads && k_cache.size(3) == row, "write_kv_: caches must be [blocks, KVH, block_size, row] for k");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (int8 || k_cache.scalar_type() == k.scalar_type()),
              "write_kv_: caches and k, v must share a dtype (or the caches be int8)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "write_kv_: bad slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(2), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_: slot ", slot[t], " out of range");
  // Row index of (slot, head) in the cache.
  auto row_of = [&](int64_t s, int64_t h) { return travelator::kv_row(s / block_size, h, s % block_size, heads, block_size); };
  if (int8) {
    int8_t* kc = k_cache.data_ptr<int8_t>();
    int8_t* vc = v_cache.data_ptr<int8_t>();
    dispatch_float_types(k, "write_kv_", [&](auto tag) {
      using T = decltype(tag);
      const T* ks = k.data_ptr<T>();
      const T* vs = v.data_ptr<T>();
      at::parallel_for(0, slots.numel(), 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            quantize_kv_row(ks + t * k.stride(0) + h * d, d, kc + row_of(slot[t], h) * row);
            quantize_kv_row(vs + t * v.stride(0) + h * d, d, vc + row_of(slot[t], h) * row);
          }
      });
    });
    return;
  }
  const int64_t row_bytes = d * static_cast<int64_t>(k.element_size());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, slots.numel(), 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kc + row_of(slot[t], h) * row_bytes, ks + t * k_stride + h * row_bytes, row_bytes);
        std::memcpy(vc + row_of(slot[t], h) * row_bytes, vs + t * v_stride + h * row_bytes, row_bytes);
      }
  });
}

// Index of each row's largest value, as torch.argmax(dim=-1): the first maximum, and the
// first NaN if a row has one. One pass for the maximum, one for its first position;
// vectorised on AVX-512 (torch's own arg-reduction is scalar-speed here). bf16 rows are
// widened exactly, so their argmax is that of their float32 copy, without making one.
#if defined(__AVX512F__)
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
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
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    has_nan |= v != v;
    best = std::max(best, v);
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16f(x + j);
    const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
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
        const float u = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
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
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor masks, Tensor rows) -> ()");
  m.def("exponential_race(Tensor scores, Tensor seeds) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("head_rms_norm_", c10::DispatchKey::CPU, &head_rms_norm_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &gelu_tanh_and_mul);
  m.impl("rope_", c10::DispatchKey::CPU, &rope_);
  m.impl("write_kv_", c10::DispatchKey::CPU, &write_kv_);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.impl("apply_token_bitmask_", c10::DispatchKey::CPU, &apply_token_bitmask_);
  m.impl("exponential_race", c10::DispatchKey::CPU, &exponential_race);
}
