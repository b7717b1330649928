// Scalar bf16 <-> fp32 conversions shared by the kernels, with c10::BFloat16's rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace tiered_router
