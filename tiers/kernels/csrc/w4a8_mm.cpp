// int4 weights x int8 activations (W4A8) GEMM for the CPU: integer dot products per weight group.
//
// Why: the bf16-activation int4 kernels (int4_mm.cpp and torch's) dequantize every weight to fp32
// and then need one fp32 multiply-add per weight per row; at 16 decode rows that is the whole step
// (~85% of it at ~85% of the FMA peak on the Zen 4 VM). Quantizing each row's activations to int8
// per weight group (llama.cpp's Q8 activations) makes the inner product an exact integer one: with
// VNNI one `vpdpbusd` is 64 multiply-adds against 16 for an fp32 FMA; without VNNI, `vpmaddubsw` +
// `vpmaddwd` give the same integers. The numbers are the W4A8 ones, not the bf16 ones: a tier opts
// in (`activations: int8` in the policy).
//
// Arithmetic (tiers/layers/quantization/quant.py `w4a8_reference` is the same in torch ops, bit for bit):
//   per row m and group g of G inputs, x = (float)A[m, gG .. gG+G) (A is bf16):
//     amax = max |x|;  inv = amax > 0 ? 127 / amax : 0 (IEEE division);  sa = amax / 127
//     xq_i = round-half-even(x_i * inv)  (in [-127, 127]);  saS = sa * (float)(sum xq_i)
//   per output channel n, with q in [0, 15], scale s and zero z (bf16) of (g, n), the weight being
//   (q - 8) s + z = q s + z8 with z8 = z - 8 s:
//     D = sum q_i xq_i  (an exact integer)
//     acc += (float)D * (s * sa) + z8 * saS   every op rounded to fp32 on its own (no FMA), g in order
//   C[m, n] = bf16(acc) (round to nearest even).
// Each output depends only on its own row and channel, never on the row count or the thread
// split, so a request's numbers do not change with the batch it runs in.
//
// Weight layout (`pack_w4a8` in tiers/layers/quantization/quant.py): for each block of 32 output channels and each
// 4 consecutive inputs ("k-quad") j, 64 bytes; byte 4c + i holds q[32b + c][4j + i] in its low
// nibble and q[32b + 16 + c][4j + i] in its high nibble. One 64-byte load is two registers of
// 16 channels x 4 inputs, the unit `vpdpbusd` multiplies and sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "bf16.h"
#include "quantize_rows.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

namespace simd = tiered_router::simd;

constexpr int kBlockN = 32;   // output channels per packed block (one task)
constexpr int kQuadBytes = 64;  // bytes per (block, k-quad)

struct Problem {
  const int8_t* xq;     // [M, K]
  const float* sa;      // [M, groups]
  const float* saS;     // [M, groups]
  const uint8_t* w;     // [N / 32, K / 4, 64]
  const uint16_t* sz;   // bf16 [groups, N, 2]: (scale, zero)
  uint16_t* out;        // bf16 [M, N]
  int64_t K, N;
  int G;
};

constexpr int kRegs = kBlockN / simd::kLanes;  // registers per row: channel c in lane c % L of register c / L

// acc[r][c] += D * (s * sa) + z8 * saS for one group of R rows x kBlockN channels, D given as
// int32 dots in that register layout.
inline void group_epilogue(const Problem& p, int64_t b, int g, int64_t m0, int R, const simd::vi (*dot)[kRegs],
                           float (*acc)[kBlockN]) {
  const int64_t groups = p.K / p.G;
  const uint16_t* row = p.sz + (static_cast<int64_t>(g) * p.N + b * kBlockN) * 2;
  simd::vf s[kRegs], z8[kRegs];
  for (int v = 0; v < kRegs; ++v) {
    simd::vf z;
    simd::load_pairs(row + 2 * simd::kLanes * v, s[v], z);
    z8[v] = simd::sub(z, simd::mul(s[v], simd::set1(8.0f)));  // 8 s is exact
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const simd::vf vsa = simd::set1(p.sa[m * groups + g]);
    const simd::vf vsaS = simd::set1(p.saS[m * groups + g]);
    for (int v = 0; v < kRegs; ++v) {
      const simd::vf D = simd::to_float(dot[r][v]);
      const simd::vf c = simd::add(simd::mul(D, simd::mul(s[v], vsa)), simd::mul(z8[v], vsaS));
      float* a = acc[r] + simd::kLanes * v;
      simd::store(a, simd::add(simd::load(a), c));
    }
  }
}

inline void store_rows(const Problem& p, int64_t b, int64_t m0, int R, const float (*acc)[kBlockN]) {
  for (int r = 0; r < R; ++r) {
    uint16_t* dst = p.out + (m0 + r) * p.N + b * kBlockN;
    for (int v = 0; v < kRegs; ++v)
      tiered_router::store_bf16(dst + simd::kLanes * v, simd::load(acc[r] + simd::kLanes * v));
  }
}

#if defined(__AVX512F__)

constexpr int kMaxRows = 8;  // 16 int32 accumulators + 2 weight registers + broadcast

// One group of R rows x 32 channels; DOT(acc, w, x) adds the u8 x s8 products of each 4-byte
// lane. A macro rather than a template parameter: the VNNI instance needs the avx512vnni target
// on the function itself, and the other must not have it (hosts without VNNI would fault).
#define W4A8_ROWS_GROUP(DOT)                                                              \
  __m512i dot[R][2];                                                                       \
  for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();              \
  const __m512i low4 = _mm512_set1_epi8(0x0F);                                             \
  [[maybe_unused]] const __m512i ones16 = _mm512_set1_epi16(1);                            \
  const int quads = p.G / 4;                                                               \
  const int64_t j0 = static_cast<int64_t>(g) * quads;                                      \
  const uint8_t* wq = p.w + (b * (p.K / 4) + j0) * kQuadBytes;                             \
  const int8_t* x = p.xq + m0 * p.K + j0 * 4;                                              \
  for (int j = 0; j < quads; ++j) {                                                        \
    const __m512i w = _mm512_loadu_si512(wq + j * kQuadBytes);                             \
    const __m512i lo = _mm512_and_si512(w, low4);                                          \
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);                    \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                                  \
      int32_t quad;                                                                        \
      std::memcpy(&quad, x + r * p.K + 4 * j, 4);                                          \
      const __m512i xb = _mm512_set1_epi32(quad);                                          \
      dot[r][0] = DOT(dot[r][0], lo, xb);                                                  \
      dot[r][1] = DOT(dot[r][1], hi, xb);                                                  \
    }                                                                                      \
  }                                                                                        \
  group_epilogue(p, b, g, m0, R, dot, acc);

// u8 x s8 pairs to s16 (|sum| <= 2 * 15 * 127: no saturation), then pairs to s32: the same
// integers as vpdpbusd.
#define W4A8_DOT_BW(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones16))

template <int R>
__attribute__((target("avx512vnni"))) void rows_group_vnni(const Problem& p, int64_t b, int g, int64_t m0,
                                                            float (*acc)[kBlockN]) {
  W4A8_ROWS_GROUP(_mm512_dpbusd_epi32)
}

template <int R>
void rows_group_bw(const Problem& p, int64_t b, int g, int64_t m0, float (*acc)[kBlockN]) {
  W4A8_ROWS_GROUP(W4A8_DOT_BW)
}

// One row against all groups of block b (a single stream's decode step). The per-group calls
// above leave one row two dependency chains (low and high nibbles) of back-to-back dot products,
// each waiting out the previous one's latency (5 cycles for vpdpbusd), and round-trip the
// accumulators through memory every group. Here the group loop is inside: odd and even quads
// accumulate in separate registers (integer sums: the same D whatever the order) and the fp32
// accumulators stay in registers. The fp32 ops and their order are group_epilogue's, so the
// output is bitwise the same. The next block's weights are prefetched, a line per quad.
#define W4A8_ONE_ROW_BLOCK(DOT)                                                             \
  const __m512i low4 = _mm512_set1_epi8(0x0F);                                             \
  [[maybe_unused]] const __m512i ones16 = _mm512_set1_epi16(1);                            \
  const int quads = p.G / 4; /* a multiple of 4: G is a multiple of 16 */                  \
  const int64_t groups = p.K / p.G;                                                        \
  const uint8_t* wq = p.w + b * (p.K / 4) * kQuadBytes;                                    \
  const uint8_t* ahead = (b + 1) * kBlockN < p.N ? wq + (p.K / 4) * kQuadBytes : nullptr;  \
  const int8_t* x = p.xq + m * p.K;                                                        \
  const float* sa = p.sa + m * groups;                                                     \
  const float* saS = p.saS + m * groups;                                                   \
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                           \
  for (int64_t g = 0; g < groups; ++g) {                                                   \
    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();                      \
    __m512i e0 = _mm512_setzero_si512(), e1 = _mm512_setzero_si512();                      \
    const int64_t j0 = g * quads;                                                          \
    for (int j = 0; j < quads; j += 2) {                                                   \
      const int64_t jj = j0 + j;                                                           \
      if (ahead != nullptr) {                                                              \
        _mm_prefetch(reinterpret_cast<const char*>(ahead + jj * kQuadBytes), _MM_HINT_T0);   \
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (jj + 1) * kQuadBytes), _MM_HINT_T0); \
      }                                                                                    \
      const __m512i w = _mm512_loadu_si512(wq + jj * kQuadBytes);                          \
      const __m512i v = _mm512_loadu_si512(wq + (jj + 1) * kQuadBytes);                    \
      int32_t qa, qb;                                                                      \
      std::memcpy(&qa, x + 4 * jj, 4);                                                     \
      std::memcpy(&qb, x + 4 * jj + 4, 4);                                                 \
      const __m512i xa = _mm512_set1_epi32(qa), xb = _mm512_set1_epi32(qb);                \
      d0 = DOT(d0, _mm512_and_si512(w, low4), xa);                                         \
      d1 = DOT(d1, _mm512_and_si512(_mm512_srli_epi16(w, 4), low4), xa);                   \
      e0 = DOT(e0, _mm512_and_si512(v, low4), xb);                                         \
      e1 = DOT(e1, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), xb);                   \
    }                                                                                      \
    const uint16_t* row = p.sz + (g * p.N + b * kBlockN) * 2;                              \
    __m512 s0, z0, s1, z1;                                                                 \
    simd::load_pairs(row, s0, z0);                                                         \
    simd::load_pairs(row + 2 * simd::kLanes, s1, z1);                                      \
    const __m512 eight = _mm512_set1_ps(8.0f);                                             \
    const __m512 vsa = _mm512_set1_ps(sa[g]), vsaS = _mm512_set1_ps(saS[g]);               \
    const __m512 D0 = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, e0));                        \
    const __m512 D1 = _mm512_cvtepi32_ps(_mm512_add_epi32(d1, e1));                        \
    const __m512 z80 = _mm512_sub_ps(z0, _mm512_mul_ps(s0, eight));                        \
    const __m512 z81 = _mm512_sub_ps(z1, _mm512_mul_ps(s1, eight));                        \
    acc0 = _mm512_add_ps(acc0, _mm512_add_ps(_mm512_mul_ps(D0, _mm512_mul_ps(s0, vsa)),    \
                                             _mm512_mul_ps(z80, vsaS)));                   \
    acc1 = _mm512_add_ps(acc1, _mm512_add_ps(_mm512_mul_ps(D1, _mm512_mul_ps(s1, vsa)),    \
                                             _mm512_mul_ps(z81, vsaS)));                   \
  }                                                                                        \
  uint16_t* dst = p.out + m * p.N + b * kBlockN;                                           \
  tiered_router::store_bf16(dst, acc0);                                                    \
  tiered_router::store_bf16(dst + simd::kLanes, acc1);

__attribute__((target("avx512vnni"))) void one_row_block_vnni(const Problem& p, int64_t b, int64_t m) {
  W4A8_ONE_ROW_BLOCK(_mm512_dpbusd_epi32)
}

void one_row_block_bw(const Problem& p, int64_t b, int64_t m) { W4A8_ONE_ROW_BLOCK(W4A8_DOT_BW) }

// TIERED_ROUTER_NO_VNNI=1 takes the maddubs path on a VNNI host too, so the tests cover both
// (read at each call: the tests set it after the library is loaded).
bool use_vnni() {
  const char* off = std::getenv("TIERED_ROUTER_NO_VNNI");
  return __builtin_cpu_supports("avx512vnni") && !(off != nullptr && off[0] == '1');
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kMaxRows = 2;  // 8 int32 accumulators + 4 unpacked weight registers + constants
constexpr int kQuadsPer16 = 8;  // quads whose pair sums fit 16 bits (one row's path)

// Register v of a row holds channels 8v..8v+7: v = 0, 1 from the low nibbles of the two 32-byte
// halves of a k-quad, v = 2, 3 from their high nibbles.
template <int R>
void rows_group_avx2(const Problem& p, int64_t b, int g, int64_t m0, float (*acc)[kBlockN]) {
  __m256i dot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) dot[r][v] = _mm256_setzero_si256();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int quads = p.G / 4;
  const int64_t j0 = static_cast<int64_t>(g) * quads;
  const uint8_t* wq = p.w + (b * (p.K / 4) + j0) * kQuadBytes;
  const int8_t* x = p.xq + m0 * p.K + j0 * 4;
  if constexpr (R == 1) {
    // The next block's same quads, a line per quad: the whole next block arrives while this one
    // computes.
    const uint8_t* ahead = (b + 1) * kBlockN < p.N ? wq + (p.K / 4) * kQuadBytes : nullptr;
    // One row (a single stream's decode step): the u8 x s8 pair sums of up to kQuadsPer16 quads
    // add up in 16 bits (|sum| <= 8 * 2 * 15 * 128 = 30720) before one widening per chunk, half the
    // multiplies per quad. The same integers as below.
    for (int j0 = 0; j0 < quads; j0 += kQuadsPer16) {
      __m256i part[4];
      for (int v = 0; v < 4; ++v) part[v] = _mm256_setzero_si256();
      const int j1 = std::min(quads, j0 + kQuadsPer16);
      for (int j = j0; j < j1; ++j) {
        if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * kQuadBytes), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + j * kQuadBytes));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + j * kQuadBytes + 32));
        int32_t quad;
        std::memcpy(&quad, x + 4 * j, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        part[0] = _mm256_add_epi16(part[0], _mm256_maddubs_epi16(_mm256_and_si256(w0, low4), xb));
        part[1] = _mm256_add_epi16(part[1], _mm256_maddubs_epi16(_mm256_and_si256(w1, low4), xb));
        part[2] = _mm256_add_epi16(part[2], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w0, 4), low4), xb));
        part[3] = _mm256_add_epi16(part[3], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w1, 4), low4), xb));
      }
      for (int v = 0; v < 4; ++v) dot[0][v] = _mm256_add_epi32(dot[0][v], _mm256_madd_epi16(part[v], ones16));
    }
    group_epilogue(p, b, g, m0, R, dot, acc);
    return;
  }
  for (int j = 0; j < quads; ++j) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + j * kQuadBytes));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + j * kQuadBytes + 32));
    const __m256i wv[4] = {_mm256_and_si256(w0, low4), _mm256_and_si256(w1, low4),
                           _mm256_and_si256(_mm256_srli_epi16(w0, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(w1, 4), low4)};
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x + r * p.K + 4 * j, 4);
      const __m256i xb = _mm256_set1_epi32(quad);
      for (int v = 0; v < 4; ++v)
        dot[r][v] = _mm256_add_epi32(dot[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v], xb), ones16));
    }
  }
  group_epilogue(p, b, g, m0, R, dot, acc);
}

#else
#error "w4a8_mm.cpp needs AVX512F or AVX2+FMA (tiers/kernels/cpu.py picks the flags)"
#endif

using GroupFn = void (*)(const Problem&, int64_t, int, int64_t, float (*)[kBlockN]);

template <template <int> class F, int... Rs>
constexpr auto make_group_fns(std::integer_sequence<int, Rs...>) {
  return std::array<GroupFn, sizeof...(Rs)>{&F<Rs + 1>::call...};
}

#if defined(__AVX512F__)
template <int R>
struct Vnni {
  static void call(const Problem& p, int64_t b, int g, int64_t m0, float (*acc)[kBlockN]) {
    rows_group_vnni<R>(p, b, g, m0, acc);
  }
};
template <int R>
struct Bw {
  static void call(const Problem& p, int64_t b, int g, int64_t m0, float (*acc)[kBlockN]) {
    rows_group_bw<R>(p, b, g, m0, acc);
  }
};
const auto kVnniFns = make_group_fns<Vnni>(std::make_integer_sequence<int, kMaxRows>{});
const auto kBwFns = make_group_fns<Bw>(std::make_integer_sequence<int, kMaxRows>{});
const auto& group_fns() { return use_vnni() ? kVnniFns : kBwFns; }
#else
template <int R>
struct Avx2 {
  static void call(const Problem& p, int64_t b, int g, int64_t m0, float (*acc)[kBlockN]) {
    rows_group_avx2<R>(p, b, g, m0, acc);
  }
};
const auto kAvx2Fns = make_group_fns<Avx2>(std::make_integer_sequence<int, kMaxRows>{});
const auto& group_fns() { return kAvx2Fns; }
#endif

at::Tensor w4a8_mm(const at::Tensor& A, const at::Tensor& W, int64_t group_size, const at::Tensor& SZ) {
  TORCH_CHECK(A.dim() == 2 && A.scalar_type() == at::kBFloat16, "w4a8_mm: A must be 2-D bf16");
  TORCH_CHECK(W.dim() == 3 && W.scalar_type() == at::kByte && W.size(2) == kQuadBytes,
              "w4a8_mm: W must be uint8 [N / 32, K / 4, 64]");
  TORCH_CHECK(SZ.dim() == 3 && SZ.scalar_type() == at::kBFloat16, "w4a8_mm: scales_and_zeros must be bf16 [K/G, N, 2]");
  const int64_t M = A.size(0), K = A.size(1), N = W.size(0) * kBlockN;
  const int G = static_cast<int>(group_size);
  TORCH_CHECK(W.size(1) * 4 == K, "w4a8_mm: W holds ", W.size(1) * 4, " inputs, A has ", K);
  TORCH_CHECK(G > 0 && G % 16 == 0 && K % G == 0, "w4a8_mm: group_size ", G, " must divide K=", K,
              " and be a multiple of 16");
  TORCH_CHECK(SZ.size(0) == K / G && SZ.size(1) == N && SZ.size(2) == 2, "w4a8_mm: scales_and_zeros shape");
  const at::Tensor a = A.contiguous();
  const at::Tensor w = W.contiguous();
  const at::Tensor sz = SZ.contiguous();
  at::Tensor C = at::empty({M, N}, A.options());
  if (M == 0) return C;

  const int64_t groups = K / G;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> sa(static_cast<size_t>(M * groups));
  std::vector<float> saS(static_cast<size_t>(M * groups));
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  // Rows are independent; below ~64 rows one thread quantizes faster than waking another.
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    tiered_router::quantize_rows(ap, K, G, m0, m1, xq.data(), sa.data(), saS.data(), nullptr);
  });

  const Problem p{xq.data(),
                  sa.data(),
                  saS.data(),
                  w.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(C.data_ptr<at::BFloat16>()),
                  K,
                  N,
                  G};
  const auto& fns = group_fns();
#if defined(__AVX512F__)
  const auto one_row = use_vnni() ? &one_row_block_vnni : &one_row_block_bw;
#endif
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows][kBlockN];
    for (int64_t b = begin; b < end; ++b) {
      // Row tiles inside the block: its weights (16 K bytes) stay in L1 across them.
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
#if defined(__AVX512F__)
        if (R == 1) {
          one_row(p, b, m0);
          continue;
        }
#endif
        std::memset(acc, 0, sizeof(acc));
        for (int g = 0; g < groups; ++g) fns[R - 1](p, b, g, m0, acc);
        store_rows(p, b, m0, R, acc);
      }
    }
  });
  return C;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("w4a8_mm(Tensor a, Tensor w, int group_size, Tensor scales_and_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) {
  m.impl("w4a8_mm", &w4a8_mm);
}
