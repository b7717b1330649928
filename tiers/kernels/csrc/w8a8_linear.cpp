// int8 weights (one scale per output channel) times int8 activations (quantized per group of G
// inputs, quantize_rows.h): W8A8, for the int8 output head of a tier whose other layers already
// take int8 activations (the medium tier: W4A8 body, 49,152 x 576 int8 head).
//
// Why: w8_linear.cpp (bf16 activations) converts every weight to fp32 and spends one fused
// multiply-add per weight per row; at one row that is compute, not the memory, on the head. With
// int8 activations the inner product is an exact integer one: one `vpdpbusd` is 64 multiply-adds;
// without VNNI, `vpmaddubsw` + `vpmaddwd` give the same integers.
//
// Arithmetic (tiers/layers/quantization/quant.py `w8a8_reference` is the same in torch ops, bit for bit):
//   per row m and group g: xq, sa as quantize_rows.h;  D = sum q_i xq_i (an exact integer);
//   acc = 0;  for g in order: acc = acc + (float)D * sa   (each op rounded to fp32 on its own)
//   C[m, n] = bf16(acc * s_n)   (round to nearest even)
// Each output depends only on its own row and channel, never on the row count or the thread
// split, so a request's numbers do not change with the batch it runs in.
//
// Weight layout (`pack_w8a8` in tiers/layers/quantization/quant.py): per block of 16 output channels and 4
// consecutive inputs ("k-quad") j, 64 bytes; byte 4c + i holds q[16b + c][4j + i] + 128 (as u8).
// VNNI multiplies u8 by s8: with the weight offset to u8, sum (q + 128) xq = D + 128 sum xq, and the
// activation sum is known per row and group. The maddubs path takes q back (xor 0x80), multiplies
// |q| (u8) by xq with q's sign (s8): each pair sum is at most 2 * 127 * 127, no saturation.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "bf16.h"
#include "quantize_rows.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

namespace simd = tiered_router::simd;

constexpr int kBlock = 16;       // output channels per packed block
constexpr int kQuadBytes = 64;   // bytes per (block, k-quad)
constexpr int kVecs = 4;  // registers per row in a task: independent dot-product chains
constexpr int kTask = kVecs * simd::kLanes;  // output channels per task: AVX512 4 blocks, AVX2 2
constexpr int kAlign = 64;  // N must be a multiple of this on every build (the largest task)

struct Problem {
  const int8_t* xq;     // [M, K]
  const float* sa;      // [M, groups]
  const int32_t* xsum;  // [M, groups]
  const uint8_t* w;     // [N / 16, K / 4, 64]
  const float* scale;   // [N]
  uint16_t* out;        // bf16 [M, N]
  int64_t K, N;
  int G;
};

// Register v of the task starting at block b0, quad j: AVX512 one block's 64 bytes; AVX2 half of one.
inline const uint8_t* quad_ptr(const Problem& p, int64_t b0, int v, int64_t j) {
  constexpr int kPerBlock = kBlock / simd::kLanes;  // registers per block: 1 or 2
  return p.w + ((b0 + v / kPerBlock) * (p.K / 4) + j) * kQuadBytes + (v % kPerBlock) * (kQuadBytes / kPerBlock);
}

// After one group: acc += (float)D * sa, D recovered from the VNNI sums where they carry the
// offset. The fp32 ops and their order are the reference's.
template <int R, bool kOffset>
inline void group_end(const Problem& p, int64_t m0, int64_t g, simd::vi (*dot)[kVecs], simd::vf (*acc)[kVecs]) {
  const int64_t groups = p.K / p.G;
  for (int r = 0; r < R; ++r) {
    const int64_t i = (m0 + r) * groups + g;
    const simd::vf vsa = simd::set1(p.sa[i]);
    for (int v = 0; v < kVecs; ++v) {
      simd::vi d = dot[r][v];
#if defined(__AVX512F__)
      if constexpr (kOffset) d = _mm512_sub_epi32(d, _mm512_set1_epi32(128 * p.xsum[i]));
      dot[r][v] = _mm512_setzero_si512();
#else
      if constexpr (kOffset) d = _mm256_sub_epi32(d, _mm256_set1_epi32(128 * p.xsum[i]));
      dot[r][v] = _mm256_setzero_si256();
#endif
      acc[r][v] = simd::add(acc[r][v], simd::mul(simd::to_float(d), vsa));
    }
  }
}

template <int R>
inline void store_task(const Problem& p, int64_t b0, int64_t m0, simd::vf (*acc)[kVecs]) {
  for (int v = 0; v < kVecs; ++v) {
    const int64_t n = b0 * kBlock + v * simd::kLanes;
    const simd::vf s = simd::load(p.scale + n);
    for (int r = 0; r < R; ++r) tiered_router::store_bf16(p.out + (m0 + r) * p.N + n, simd::mul(acc[r][v], s));
  }
}

#if defined(__AVX512F__)

constexpr int kMaxRows = 4;  // rows per tile: 16 int32 and 16 fp32 accumulators + 4 weight registers

// R rows x one task (64 channels) over all of K. DOT_PREP(v) turns the loaded weight register
// w[v] into what DOT(acc, v, xb) multiplies; kOffset: the sums carry 128 * sum xq.
#define W8A8_TASK(DOT_PREP, DOT, OFFSET)                                                   \
  simd::vi dot[R][kVecs];                                                                  \
  simd::vf acc[R][kVecs];                                                                  \
  for (int r = 0; r < R; ++r)                                                              \
    for (int v = 0; v < kVecs; ++v) {                                                      \
      dot[r][v] = _mm512_setzero_si512();                                                  \
      acc[r][v] = _mm512_setzero_ps();                                                     \
    }                                                                                      \
  [[maybe_unused]] const __m512i ones16 = _mm512_set1_epi16(1);                            \
  [[maybe_unused]] const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));         \
  const int quads = p.G / 4;                                                               \
  const int64_t groups = p.K / p.G;                                                        \
  for (int64_t g = 0; g < groups; ++g) {                                                   \
    for (int jq = 0; jq < quads; ++jq) {                                                   \
      const int64_t j = g * quads + jq;                                                    \
      __m512i w[kVecs];                                                                    \
      for (int v = 0; v < kVecs; ++v) {                                                    \
        w[v] = _mm512_loadu_si512(quad_ptr(p, b0, v, j));                                  \
        DOT_PREP(v);                                                                       \
      }                                                                                    \
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                \
        int32_t quad;                                                                      \
        std::memcpy(&quad, p.xq + (m0 + r) * p.K + 4 * j, 4);                              \
        const __m512i xb = _mm512_set1_epi32(quad);                                        \
        for (int v = 0; v < kVecs; ++v) dot[r][v] = DOT(dot[r][v], v, xb);                 \
      }                                                                                    \
    }                                                                                      \
    group_end<R, OFFSET>(p, m0, g, dot, acc);                                              \
  }                                                                                        \
  store_task<R>(p, b0, m0, acc);

#define W8A8_PREP_NONE(v)
#define W8A8_DOT_VNNI(acc, v, xb) _mm512_dpbusd_epi32(acc, w[v], xb)
// q = w ^ 0x80 (s8); |q| as u8 in w, q's sign as a mask in neg[v].
#define W8A8_PREP_BW(v)                                       \
  {                                                           \
    const __m512i q = _mm512_xor_si512(w[v], flip);           \
    neg[v] = _mm512_movepi8_mask(q);                          \
    w[v] = _mm512_abs_epi8(q);                                \
  }
#define W8A8_DOT_BW(acc, v, xb)                                                                        \
  _mm512_add_epi32(acc, _mm512_madd_epi16(                                                             \
                            _mm512_maddubs_epi16(w[v], _mm512_mask_sub_epi8(xb, neg[v], _mm512_setzero_si512(), xb)), \
                            ones16))

template <int R>
__attribute__((target("avx512vnni"))) void task_vnni(const Problem& p, int64_t b0, int64_t m0) {
  W8A8_TASK(W8A8_PREP_NONE, W8A8_DOT_VNNI, true)
}

template <int R>
void task_bw(const Problem& p, int64_t b0, int64_t m0) {
  __mmask64 neg[kVecs];
  W8A8_TASK(W8A8_PREP_BW, W8A8_DOT_BW, false)
}

// TIERED_ROUTER_NO_VNNI=1 takes the maddubs path on a VNNI host too, so the tests cover both.
bool use_vnni() {
  const char* off = std::getenv("TIERED_ROUTER_NO_VNNI");
  return __builtin_cpu_supports("avx512vnni") && !(off != nullptr && off[0] == '1');
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kMaxRows = 2;  // rows per tile: 8 int32 and 8 fp32 accumulators + 8 weight registers

template <int R>
void task_avx2(const Problem& p, int64_t b0, int64_t m0) {
  simd::vi dot[R][kVecs];
  simd::vf acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) {
      dot[r][v] = _mm256_setzero_si256();
      acc[r][v] = _mm256_setzero_ps();
    }
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const int quads = p.G / 4;
  const int64_t groups = p.K / p.G;
  for (int64_t g = 0; g < groups; ++g) {
    for (int jq = 0; jq < quads; ++jq) {
      const int64_t j = g * quads + jq;
      __m256i q[kVecs], a[kVecs];
      for (int v = 0; v < kVecs; ++v) {
        q[v] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad_ptr(p, b0, v, j))), flip);
        a[v] = _mm256_abs_epi8(q[v]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, p.xq + (m0 + r) * p.K + 4 * j, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int v = 0; v < kVecs; ++v)
          dot[r][v] = _mm256_add_epi32(
              dot[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(a[v], _mm256_sign_epi8(xb, q[v])), ones16));
      }
    }
    group_end<R, false>(p, m0, g, dot, acc);
  }
  store_task<R>(p, b0, m0, acc);
}

#else
#error "w8a8_linear.cpp needs AVX512F or AVX2+FMA (tiers/kernels/cpu.py picks the flags)"
#endif

using TaskFn = void (*)(const Problem&, int64_t, int64_t);

template <int R>
TaskFn task_fn() {
#if defined(__AVX512F__)
  return use_vnni() ? &task_vnni<R> : &task_bw<R>;
#else
  return &task_avx2<R>;
#endif
}

at::Tensor w8a8_linear(const at::Tensor& A, const at::Tensor& W, int64_t group_size, const at::Tensor& scale) {
  TORCH_CHECK(A.dim() == 2 && A.scalar_type() == at::kBFloat16, "w8a8_linear: A must be 2-D bf16");
  TORCH_CHECK(W.dim() == 3 && W.scalar_type() == at::kByte && W.size(2) == kQuadBytes,
              "w8a8_linear: W must be uint8 [N / 16, K / 4, 64]");
  const int64_t M = A.size(0), K = A.size(1), N = W.size(0) * kBlock;
  const int G = static_cast<int>(group_size);
  TORCH_CHECK(W.size(1) * 4 == K, "w8a8_linear: W holds ", W.size(1) * 4, " inputs, A has ", K);
  TORCH_CHECK(N % kAlign == 0, "w8a8_linear: ", N, " output channels, not a multiple of ", kAlign);
  // |D| <= G * 127 * 127 must stay below 2^24, where int32 -> fp32 is exact (the reference's sums).
  TORCH_CHECK(G > 0 && G % 16 == 0 && K % G == 0 && G <= 1024, "w8a8_linear: group_size ", G,
              " must divide K=", K, ", be a multiple of 16 and at most 1024");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat,
              "w8a8_linear: scale must be fp32 [N]");
  TORCH_CHECK(A.device().is_cpu() && W.device().is_cpu() && scale.device().is_cpu(), "w8a8_linear: CPU tensors only");
  const at::Tensor a = A.contiguous();
  const at::Tensor w = W.contiguous();
  const at::Tensor s = scale.contiguous();
  at::Tensor C = at::empty({M, N}, A.options());
  if (M == 0) return C;

  const int64_t groups = K / G;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> sa(static_cast<size_t>(M * groups)), saS(static_cast<size_t>(M * groups));
  std::vector<int32_t> xsum(static_cast<size_t>(M * groups));
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    tiered_router::quantize_rows(ap, K, G, m0, m1, xq.data(), sa.data(), saS.data(), xsum.data());
  });
  const Problem p{xq.data(), sa.data(), xsum.data(), w.data_ptr<uint8_t>(), s.data_ptr<float>(),
                  reinterpret_cast<uint16_t*>(C.data_ptr<at::BFloat16>()), K, N, G};
  TaskFn fns[kMaxRows];
  fns[0] = task_fn<1>();
  fns[1] = task_fn<2>();
#if defined(__AVX512F__)
  fns[2] = task_fn<3>();
  fns[3] = task_fn<4>();
#endif
  at::parallel_for(0, N / kTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Row tiles inside the task: its weights (64 x K bytes) stay in L1/L2 across them.
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
        fns[R - 1](p, t * (kTask / kBlock), m0);
      }
    }
  });
  return C;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("w8a8_linear(Tensor a, Tensor w, int group_size, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
