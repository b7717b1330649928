// Scalar bf16 <-> fp32 conversions shared by the kernels, with c10::BFloat16's rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tiered_router {

inline float bf16_to_float(uint16_t v) {  // exact: bf16 is fp32's high half
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN -> 0x7fc0 (c10::BFloat16)
  if (std::isnan(f)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

// An element of a kernel's activation type T (float, or bf16 held as uint16_t) as fp32, and an
// fp32 value stored as T (one rounding for bf16, exact for float).
template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return bf16_to_float(v);
}

template <typename T>
inline T from_float(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return float_to_bf16(v);
}

}  // namespace tiered_router
