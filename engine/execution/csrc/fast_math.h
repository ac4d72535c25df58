// Math shared by the engine's C++ CPU kernels (attention/csrc, layers/csrc): one copy of the exponential.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace shoal {

// 2^y for y in [-127, 127], branch-free and vectorisable (no libm call). y = n + f with n = round(y) and
// f in [-0.5, 0.5]; 2^f by its Taylor polynomial to degree 7 (relative error < 1e-8, below float rounding); 2^n by
// writing n + 127 into the exponent bits, so y = -127 gives exponent bits 0: exactly 0 (what softmax wants for
// -inf). Rounding uses the 1.5 * 2^23 trick, valid because the kernels are not built with -ffast-math (the
// compiler may not fold (y + C) - C into y).
inline float exp2_poly(float y) {
  const float n = (y + 12582912.0f) - 12582912.0f;
  const float f = (y - n) * 0.6931471805599453f;  // 2^f = e^(f ln 2)
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  return p * pow2n;
}

// 2^x for x <= 0: -inf and anything below -127 give 0.
inline float exp2_neg(float x) { return exp2_poly(std::max(x, -127.0f)); }

// e^x, saturating at ~1.7e38 and ~1e-38 (2^n stays a normal float): what SiLU needs, since x / (1 + e^-x) is then
// x or ~0, as in float32 arithmetic.
inline float exp_approx(float x) { return exp2_poly(std::min(std::max(x * 1.4426950408889634f, -126.0f), 127.0f)); }

}  // namespace shoal
