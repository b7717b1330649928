// Activations quantized to int8 per group of G inputs, per row (llama.cpp's Q8 activations): the
// shared first step of the integer-activation kernels (w4a8_mm.cpp, w8a8_linear.cpp). The
// arithmetic, which tiers/layers/quantization/quant.py's references repeat in torch ops:
//   x = (float)A[m, gG .. gG+G);  amax = max |x|;  inv = amax > 0 ? 127 / amax : 0 (one IEEE
//   division);  sa = amax / 127;  xq_i = round-half-even(x_i * inv) in [-127, 127]
// Outputs per row and group: xq, sa, saS = sa * (float)(sum xq_i) and, where asked, the sum itself.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace tiered_router {

// Rows [m0, m1) of A (bf16 [M, K]): xq int8 [M, K]; sa, saS (and xsum, unless null) [M, K / G].
inline void quantize_rows(const uint16_t* a, int64_t K, int G, int64_t m0, int64_t m1, int8_t* xq, float* sa,
                          float* saS, int32_t* xsum) {
  const int64_t groups = K / G;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* src = a + m * K + g * G;
      int8_t* dst = xq + m * K + g * G;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_setzero_ps();
      for (int i = 0; i < G; i += 16) {
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16));
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
      }
      const float amax = _mm512_reduce_max_ps(vmax);
#else
      __m256 vmax = _mm256_setzero_ps();
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      for (int i = 0; i < G; i += 8) {
        const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16));
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(x, absmask));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, vmax);
      float amax = 0.0f;
      for (float v : lanes) amax = std::max(amax, v);
#endif
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float scale = amax / 127.0f;
      sa[m * groups + g] = scale;
      int32_t sum = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i vsum = _mm512_setzero_si512();
      for (int i = 0; i < G; i += 16) {
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16));
        // cvtps rounds by MXCSR: to nearest even, as torch.round.
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x, vinv));
        vsum = _mm512_add_epi32(vsum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(q));
      }
      sum = _mm512_reduce_add_epi32(vsum);
#else
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int i = 0; i < G; i += 8) {
        const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16));
        int32_t q[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_cvtps_epi32(_mm256_mul_ps(x, vinv)));
        for (int j = 0; j < 8; ++j) {
          dst[i + j] = static_cast<int8_t>(q[j]);
          sum += q[j];
        }
      }
#endif
      saS[m * groups + g] = scale * static_cast<float>(sum);
      if (xsum != nullptr) xsum[m * groups + g] = sum;
    }
  }
}

}  // namespace tiered_router
