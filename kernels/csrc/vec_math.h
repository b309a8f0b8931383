// Math the kernels vectorise: plain C++ the compiler turns into SIMD code (glibc's
// vectorised expf is only declared under -ffast-math, which these kernels avoid).
#pragma once

#include <cstdint>
#include <cstring>

namespace vlmserve {

// e^x to about 1 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r, times 2^n built in the exponent bits). Inputs below -87 give 0.
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.f ? 0.f : p * scale;
}

inline float silu(float x) { return x / (1.f + exp_approx(-x)); }

}  // namespace vlmserve
