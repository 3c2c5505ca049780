// How a linear layer's weight is multiplied, decided once when the weight is prepared
// (travelator/model/native_linear.py) and passed to the native layer stack as an integer.
// travelator/model/linear_route.py holds the same names and values; a test checks the two.
#pragma once

#include <cstdint>

enum class LinearRoute : int64_t {
  // bf16 weight with a oneDNN-packed bf16 copy; a few rows of x stream the weight as loaded
  // through small_m_linear (no bias).
  kOnednnBf16 = 0,
  // int8 weight: a packed, b scales (quant_linear_int8).
  kInt8 = 1,
  // int4 weight: a packed, b scales_zeros, and its group (quant_linear_int4).
  kInt4 = 2,
  // bf16 weight laid out for blocked_linear, at every row count (bias or not).
  kBlocked = 3,
  // bf16 weight with a oneDNN-packed float32 copy (a CPU without a bf16 GEMM); a few rows
  // stream as kOnednnBf16.
  kOnednnFloat32 = 4,
  // int4 weight whose codes are e2m1 (MXFP4): as kInt4, through quant_common.h's levels.
  kInt4Fp4 = 5,
  // bf16 weight laid out in 16-column panels for panel_linear (AVX2: float32 sums, no bf16
  // GEMM); a few rows stream the panels too (panel_linear).
  kPanels = 6,
};
