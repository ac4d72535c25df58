// The storage types the engine's C++ CPU kernels read and write (float, c10::Half, c10::BFloat16), to and from the
// float32 they compute in: one copy for every kernel (attention/csrc, layers/csrc).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace shoal {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// bfloat16 is the top half of a float32: a shift, which the compiler vectorises (c10's operator float is opaque
// enough that it may not).
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }  // c10::BFloat16 and c10::Half round to nearest even

}  // namespace shoal
