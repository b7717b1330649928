// The few vector operations the paged attention and W4A8 kernels need, for the instruction set the
// build targets (tiers/kernels/cpu.py picks -mavx512* or -mavx2 -mfma by what torch dispatches on
// the host): 16 lanes on AVX512, 8 on AVX2. Same arithmetic on both apart from the lane count,
// which changes only the order of the fp32 sums inside a dot product.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tiered_router::simd {

#if defined(__AVX512F__)

constexpr int64_t kLanes = 16;
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const uint16_t* p) {  // bf16 -> fp32 is exact: shift into the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline vf round_nearest(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// The first n (< kLanes) lanes of p, zeros after them; and the matching partial store.
inline vf load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline void store_first(float* p, vf v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
}
// p * 2^n for integral n in [-126, 0] (scalef also flushes below that to 0).
inline vf scale_by_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
using vi = __m512i;
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
// kLanes (scale, zero) bf16 pairs, one per 32-bit lane, as fp32 scales and zeros (exact).
inline void load_pairs(const uint16_t* p, vf& scale, vf& zero) {
  const __m512i pair = _mm512_loadu_si512(p);
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  zero = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int64_t kLanes = 8;
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf round_nearest(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256i first_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_mask(n)); }
inline void store_first(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, first_mask(n), v); }
// p * 2^n for integral n in [-126, 0]: n + 127 is a normal float's exponent field.
inline vf scale_by_pow2(vf p, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
using vi = __m256i;
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline void load_pairs(const uint16_t* p, vf& scale, vf& zero) {
  const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  scale = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
  zero = _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

#else
#error "the CPU kernels need AVX512F or AVX2+FMA (tiers/kernels/cpu.py picks the flags)"
#endif

// exp(x) for x <= 0 (scores minus their max): Cephes' expf range reduction and polynomial
// (x = n ln2 + r, |r| <= ln2 / 2, ln2 split in two for an exact n ln2), ~1 ulp. x is clamped at
// -87 (exp(-87) ~ 1.6e-38, fp32's smallest normal is 1.2e-38) so 2^n stays a normal number; a
// probability that small is below an fp32 sum's rounding of the row's largest term, 1.
inline vf exp_nonpositive(vf x) {
  x = max(x, set1(-87.0f));
  const vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale_by_pow2(p, n);
}

}  // namespace tiered_router::simd
