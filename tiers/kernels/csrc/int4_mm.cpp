// int4 weight-only GEMM for the CPU that dequantizes each weight group once for all rows.
//
// Why: torch's `_weight_int4pack_mm_for_cpu` walks the rows in blocks of four and dequantizes every
// weight again for each block, so at 16 decode rows it dequantizes each weight four times and
// spends about as many vector ops on dequantizing and broadcasting as on the multiply-adds. This
// kernel takes the same packed weights and scales, dequantizes one group of `group_size` inputs x
// 32 output channels into an L1-resident fp32 tile, then runs every row against that tile.
//
// torch builds that kernel once per instruction set and picks one at run time; the two builds
// differ in packed layout and in arithmetic, so this file has one variant for each, compiled by
// the flags the build chooses for this host (tiers/kernels/cpu.py), and Python uses it only where
// torch dispatches the matching build.
//
// Bitwise contract, both variants: each output is the same chain of fp32 fused multiply-adds as
// torch's kernel - accumulator starts at 0.0, k runs 0..K-1 in order, activation = (float)bf16,
// result rounded to bf16 to nearest-even (NaN -> 0xffff) - and the weight is dequantized with
// torch's own roundings, so the outputs equal torch's bit for bit at every row count
// (tests/tiers/kernels/test_cpu_kernels.py checks this against the torch op):
// - AVX512: weight = fma(q - 8, scale, zero) (q - 8 by table lookup).
// - AVX2:   weight = fma((float)q, scale, fma(scale, -8, zero)).
//
// Weight layouts (torch's `_convert_weight_to_int4pack_for_cpu` on each build):
// - AVX512: for each block of 64 output channels, K rows of 32 bytes; byte d (0..15) holds channel
//   d in its low nibble and channel d+32 in its high nibble, byte 16+d holds 16+d and 48+d.
// - AVX2: for each block of 32 output channels, K rows of 16 bytes; byte d holds channel d in its
//   low nibble and channel d+16 in its high nibble.
// Scales and zeros are bf16 [K / group_size, N, 2] on both.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "bf16.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using tiered_router::bf16_to_float;
#if defined(__AVX512F__)
using tiered_router::float_to_bf16x16;
#else
using tiered_router::float_to_bf16x8;
#endif

constexpr int kTaskN = 32;  // output channels per task: the width of one dequantized tile

#if defined(__AVX512F__)

constexpr int kBlockN = 64;   // output channels per packed block
constexpr int kMaxRows = 12;  // rows per register tile: 24 accumulators + 2 weight vectors + 1

// acc[R rows][32 channels] += A[R rows][k0..k0+G) x tile[G][32], k in order.
template <int R>
inline void rows_times_tile(const float* a, int lda, const float* tile, int G, float* acc) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    c0[r] = _mm512_loadu_ps(acc + r * kTaskN);
    c1[r] = _mm512_loadu_ps(acc + r * kTaskN + 16);
  }
  for (int k = 0; k < G; ++k) {
    const __m512 b0 = _mm512_load_ps(tile + k * kTaskN);
    const __m512 b1 = _mm512_load_ps(tile + k * kTaskN + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 va = _mm512_set1_ps(a[r * lda + k]);
      c0[r] = _mm512_fmadd_ps(va, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(va, b1, c1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * kTaskN, c0[r]);
    _mm512_storeu_ps(acc + r * kTaskN + 16, c1[r]);
  }
}

// A task is half a 64-channel block: h = 0 takes the low 16 bytes of each K row (channels 0..15
// low nibbles, 32..47 high), h = 1 the high 16 bytes (16..31, 48..63). Tile columns 0..15 are the
// low nibbles, 16..31 the high ones.
inline void task_channels(int64_t t, int& n_lo, int& n_hi) {
  n_lo = static_cast<int>((t / 2) * kBlockN + 16 * (t % 2));
  n_hi = n_lo + 32;
}

inline void dequant_group(const uint8_t* b, int64_t K, const uint16_t* sz, int N, int64_t t, int g, int G,
                          float* tile) {
  int n_lo, n_hi;
  task_channels(t, n_lo, n_hi);
  // Each (scale, zero) bf16 pair is one 32-bit lane: scale in the low half, zero in the high
  // half; shifting each half to the top of its lane is the exact bf16 -> fp32 conversion.
  const uint16_t* row = sz + static_cast<int64_t>(g) * N * 2;
  const __m512i p_lo = _mm512_loadu_si512(row + n_lo * 2);
  const __m512i p_hi = _mm512_loadu_si512(row + n_hi * 2);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 s_lo = _mm512_castsi512_ps(_mm512_slli_epi32(p_lo, 16));
  const __m512 s_hi = _mm512_castsi512_ps(_mm512_slli_epi32(p_hi, 16));
  const __m512 z_lo = _mm512_castsi512_ps(_mm512_and_si512(p_lo, top));
  const __m512 z_hi = _mm512_castsi512_ps(_mm512_and_si512(p_hi, top));
  // q -> (q - 8) by table lookup on the low 4 bits of each lane, as torch does.
  const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const uint8_t* src = b + (t / 2) * K * 32 + static_cast<int64_t>(g) * G * 32 + 16 * (t % 2);
  for (int k = 0; k < G; ++k) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * 32)));
    const __m512 lo = _mm512_permutexvar_ps(q, lut);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
    _mm512_store_ps(tile + k * kTaskN, _mm512_fmadd_ps(lo, s_lo, z_lo));
    _mm512_store_ps(tile + k * kTaskN + 16, _mm512_fmadd_ps(hi, s_hi, z_hi));
  }
}

inline void store_task(const float* acc, int64_t t, uint16_t* out) {
  int n_lo, n_hi;
  task_channels(t, n_lo, n_hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n_lo), float_to_bf16x16(_mm512_loadu_ps(acc)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n_hi), float_to_bf16x16(_mm512_loadu_ps(acc + 16)));
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kBlockN = 32;  // output channels per packed block: one task
constexpr int kMaxRows = 3;  // rows per register tile: 12 accumulators, weights read from L1

// acc[R rows][32 channels] += A[R rows][k0..k0+G) x tile[G][32], k in order.
template <int R>
inline void rows_times_tile(const float* a, int lda, const float* tile, int G, float* acc) {
  __m256 c[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) c[r][j] = _mm256_loadu_ps(acc + r * kTaskN + 8 * j);
  for (int k = 0; k < G; ++k) {
    const float* w = tile + k * kTaskN;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 va = _mm256_broadcast_ss(a + r * lda + k);
      for (int j = 0; j < 4; ++j) c[r][j] = _mm256_fmadd_ps(va, _mm256_load_ps(w + 8 * j), c[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + r * kTaskN + 8 * j, c[r][j]);
}

// A task is one 32-channel block; tile column c is channel 32t + c.
inline void dequant_group(const uint8_t* b, int64_t K, const uint16_t* sz, int N, int64_t t, int g, int G,
                          float* tile) {
  const uint16_t* row = sz + (static_cast<int64_t>(g) * N + t * kBlockN) * 2;
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 s[4], z[4];
  for (int j = 0; j < 4; ++j) {  // channels 8j..8j+7: one (scale, zero) pair per 32-bit lane
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
    s[j] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
    // torch folds the -8 offset into the zero once per group: zero' = fma(scale, -8, zero).
    z[j] = _mm256_fmadd_ps(s[j], _mm256_set1_ps(-8.0f), _mm256_castsi256_ps(_mm256_and_si256(p, top)));
  }
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const uint8_t* src = b + t * K * 16 + static_cast<int64_t>(g) * G * 16;
  for (int k = 0; k < G; ++k) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * 16));
    const __m256i q0 = _mm256_cvtepu8_epi32(bytes);                     // bytes 0..7
    const __m256i q1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));  // bytes 8..15
    float* w = tile + k * kTaskN;
    _mm256_store_ps(w + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low4)), s[0], z[0]));
    _mm256_store_ps(w + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low4)), s[1], z[1]));
    _mm256_store_ps(w + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), s[2], z[2]));
    _mm256_store_ps(w + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), s[3], z[3]));
  }
}

inline void store_task(const float* acc, int64_t t, uint16_t* out) {
  for (int j = 0; j < 4; ++j)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + t * kBlockN + 8 * j), float_to_bf16x8(_mm256_loadu_ps(acc + 8 * j)));
}

#else
#error "int4_mm.cpp needs AVX512F or AVX2+FMA (tiers/kernels/cpu.py picks the flags)"
#endif

using TileFn = void (*)(const float*, int, const float*, int, float*);

template <int... Rs>
constexpr auto make_tile_fns(std::integer_sequence<int, Rs...>) {
  return std::array<TileFn, sizeof...(Rs)>{&rows_times_tile<Rs + 1>...};
}

const auto kTileFns = make_tile_fns(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor int4_mm(const at::Tensor& A, const at::Tensor& B, int64_t group_size, const at::Tensor& SZ) {
  TORCH_CHECK(A.dim() == 2 && A.scalar_type() == at::kBFloat16, "int4_mm: A must be 2-D bf16");
  TORCH_CHECK(B.dim() == 2 && B.scalar_type() == at::kByte, "int4_mm: B must be packed uint8 [N, K/2]");
  TORCH_CHECK(SZ.dim() == 3 && SZ.scalar_type() == at::kBFloat16, "int4_mm: scales_and_zeros must be bf16 [K/G, N, 2]");
  const int64_t M = A.size(0), K = A.size(1), N = B.size(0);
  const int G = static_cast<int>(group_size);
  TORCH_CHECK(B.size(1) * 2 == K, "int4_mm: B holds ", B.size(1) * 2, " inputs, A has ", K);
  TORCH_CHECK(N % kBlockN == 0, "int4_mm: N=", N, " is not a multiple of ", kBlockN);
  TORCH_CHECK(G > 0 && K % G == 0, "int4_mm: K=", K, " is not a multiple of group_size ", G);
  TORCH_CHECK(SZ.size(0) == K / G && SZ.size(1) == N && SZ.size(2) == 2, "int4_mm: scales_and_zeros shape");
  const at::Tensor a_bf = A.contiguous();
  const at::Tensor b = B.contiguous();
  const at::Tensor sz = SZ.contiguous();
  at::Tensor C = at::empty({M, N}, A.options());
  if (M == 0) return C;

  // Activations to fp32 once: every task broadcasts from them.
  at::Tensor a_f = a_bf.to(at::kFloat);
  const float* af = a_f.data_ptr<float>();
  const uint8_t* bp = b.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint16_t* cp = reinterpret_cast<uint16_t*>(C.data_ptr<at::BFloat16>());
  const int groups = static_cast<int>(K / G);
  const int64_t tasks = N / kTaskN;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_buf(static_cast<size_t>(M) * kTaskN + 16);
    std::vector<float> tile_buf(static_cast<size_t>(G) * kTaskN + 16);
    float* acc = acc_buf.data();
    float* tile = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(tile_buf.data()) + 63) & ~uintptr_t(63));
    for (int64_t t = begin; t < end; ++t) {
      std::memset(acc, 0, sizeof(float) * M * kTaskN);
      for (int g = 0; g < groups; ++g) {
        dequant_group(bp, K, szp, static_cast<int>(N), t, g, G, tile);
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
          kTileFns[rows - 1](af + m0 * K + static_cast<int64_t>(g) * G, static_cast<int>(K), tile, G,
                             acc + m0 * kTaskN);
        }
      }
      for (int64_t m = 0; m < M; ++m) store_task(acc + m * kTaskN, t, cp + m * N);
    }
  });
  return C;
}

}  // namespace

TORCH_LIBRARY(tiered_router, m) {
  m.def("int4_mm(Tensor a, Tensor b, int group_size, Tensor scales_and_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) {
  m.impl("int4_mm", &int4_mm);
}
