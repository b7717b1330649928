// Scalar bf16 <-> fp32 conversions shared by the kernels, with c10::BFloat16's rounding.
#pragma once

#include <immintrin.h>

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

#if defined(__AVX512F__)

// Round-to-nearest-even fp32 -> bf16 of 16 lanes, NaN -> 0xffff (torch's cvtfp32_bf16).
inline __m256i float_to_bf16x16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i t = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  t = _mm512_mask_blend_epi32(nan, t, _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(t);
}

inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), float_to_bf16x16(v));
}

#elif defined(__AVX2__)

// Round-to-nearest-even fp32 -> bf16 of 8 lanes, NaN -> 0xffff (torch's cvtfp32_bf16).
inline __m128i float_to_bf16x8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i t = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
  t = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), t, ordered);
  return _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

inline void store_bf16(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), float_to_bf16x8(v));
}

#endif

}  // namespace tiered_router
