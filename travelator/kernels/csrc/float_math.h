// Small float helpers shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace travelator {

// exp(x) by range reduction (x = n ln2 + r) and a degree-6 polynomial (Cephes' expf), in
// plain float arithmetic: the compiler vectorises it (a libm call per element would not
// be) and it gives the same result on every call. Inputs are clamped to [-87, 88].
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.98756912e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 5.00000000e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace travelator
