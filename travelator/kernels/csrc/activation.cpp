// The gated activations of the MLP: SiLU(gate) * up and GELU-tanh(gate) * up (GeGLU).

#include <torch/library.h>

#include "float_math.h"
#include "row_common.h"

namespace {

using namespace travelator::rows;
#if defined(TRAVELATOR_VEC16)
namespace v16 = travelator::vec16;
#endif
#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;
#endif

// act(gate) = gate * sigmoid(a) with a = gate (SiLU) or a = 2 sqrt(2/pi) (gate + 0.044715 gate^3)
// (tanh-approximated GELU: 0.5 x (1 + tanh(z)) is x sigmoid(2 z)), so one loop serves both.
constexpr float kGeluScale = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

inline float sigmoid_arg(float x, bool gelu) { return gelu ? kGeluScale * (x + kGeluCubic * x * x * x) : x; }

#if defined(TRAVELATOR_VEC8)
// act(x) on 8 lanes, rounded to T and widened back.
template <typename T>
inline __m256 act8(__m256 x, bool gelu) {
  const __m256 arg = gelu ? _mm256_mul_ps(_mm256_set1_ps(kGeluScale),
                                          _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluCubic), x),
                                                          _mm256_mul_ps(x, x), x))
                          : x;
  const __m256 e = v8::exp(_mm256_sub_ps(_mm256_setzero_ps(), arg));
  return v8::round_as(T{}, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

// The vector part of a row: bf16 16 values at a time, the even-indexed and the odd ones in
// turn (in-order widening and narrowing take lane-crossing shuffles, a large share of the
// loop); then 8 lanes at a time. Returns where the scalar tail starts.
template <typename T>
int64_t act_mul_vectors(const T* g, const T* u, T* o, int64_t inter, bool gelu) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= inter; i += 16) {
      __m256 g_even, g_odd, u_even, u_odd;
      v8::load_even_odd(g + i, g_even, g_odd);
      v8::load_even_odd(u + i, u_even, u_odd);
      v8::store_even_odd(o + i, _mm256_mul_ps(act8<T>(g_even, gelu), u_even),
                         _mm256_mul_ps(act8<T>(g_odd, gelu), u_odd));
    }
  }
  if constexpr (kVectorised<T>) {
    for (; i + 8 <= inter; i += 8) v8::store(o + i, _mm256_mul_ps(act8<T>(v8::load(g + i), gelu), v8::load(u + i)));
  }
  return i;
}
#endif

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
      i = act_mul_vectors(g, u, o, inter, gelu);  // then the row's tail by the scalar steps below
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &gelu_tanh_and_mul);
}
