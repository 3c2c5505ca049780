// What the quantized kernels share (quant_linear.cpp, quant_dequantize.cpp and their
// instruction-set paths): the packed layout's tile, and x's integer form.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec16.h"
#include "vec8.h"

namespace travelator::quant {

#if defined(TRAVELATOR_VEC8)
namespace v8 = travelator::vec8;
#endif

constexpr int64_t kTileRows = 64;     // output rows of a tile: 4 vectors of 16 lanes (AVX2: 8 of 8)

// fn((float*)nullptr) or fn((c10::BFloat16*)nullptr), as `dtype` says.
template <typename Fn>
auto with_float_type(at::ScalarType dtype, Fn fn) {
  if (dtype == at::kFloat) return fn(static_cast<float*>(nullptr));
  return fn(static_cast<c10::BFloat16*>(nullptr));
}

inline void check_packed(const at::Tensor& packed, const char* name) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == 4 && packed.size(3) == kTileRows, name, ": bad packed layout");
}

// What an int4 layer's 4-bit codes stand for: w = (level(q) - 8) * scale + zero per group,
// level(q) = q for uniform int4, or, for e2m1 (the fp4 of MXFP4 checkpoints: 0, 0.5, 1, 1.5,
// 2, 3, 4, 6 and their negatives), twice the value plus 12, so that zero = -4 * scale makes
// w = value * 2 * scale. Levels stay within an unsigned byte's 0..24: the integer sums
// hold them as they hold uniform codes.
enum class Codebook : int64_t { kUniform = 0, kE2M1 = 1 };
constexpr uint8_t kE2M1Levels[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// An int4 layer's group scales and zeros (scales_zeros) are 16 bits each: fp16 for uniform
// codes (GGUF's Q4_0 / Q4_1 scales are fp16, and 16 bits stream a sixth fewer bytes than 32
// at groups of 32), bf16 for e2m1 ones (powers of two over E8M0's whole range); vec16.h and
// vec8.h widen either.
template <bool E2M1>
using GroupParam = std::conditional_t<E2M1, c10::BFloat16, c10::Half>;

inline void check_scales_zeros(const at::Tensor& scales_zeros, Codebook codebook, const char* name) {
  TORCH_CHECK(scales_zeros.scalar_type() == (codebook == Codebook::kE2M1 ? at::kBFloat16 : at::kHalf),
              name, ": scales_zeros must be float16 (uniform codes) or bfloat16 (e2m1 codes)");
}

inline Codebook check_codebook(int64_t codebook, const char* name) {
  TORCH_CHECK(codebook == 0 || codebook == 1, name, ": codebook must be 0 (uniform) or 1 (e2m1)");
  return static_cast<Codebook>(codebook);
}

constexpr int64_t kInt8Block = 128;   // inputs per block of x's integer form (int8 weights)
constexpr int32_t kXMax = 32512;      // 127 * 256: hi stays a signed byte
constexpr float kXMinTop = 1e-30f;    // blocks of x below this are taken as zero

// x in integers: per row xi [K] in the form the tiles take, and per block its scale and sum
// of xi.
struct IntegerX {
  std::vector<int8_t> hi, lo;  // xi's signed bytes: the AVX-512 tiles' operands
  std::vector<int16_t> pairs;  // xi in the AVX2 tiles' pair order (quant_tiles_avx2.h)
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t K = 0, block = 0, blocks = 0;
};

}  // namespace travelator::quant
