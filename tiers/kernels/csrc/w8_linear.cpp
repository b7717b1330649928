// int8 weights (one scale per output channel) times bf16 activations, y = (x @ q.T) * scale in
// fp32, rounded to bf16: the numerics of torch's _weight_int8pack_mm, for the int8 layers of the
// quantized tiers (the medium tier's output head: 49,152 x 576).
//
// Why: torch's CPU kernel for this op is a third of the medium tier's one-stream decode step on the
// 2-core AMD EPYC AVX2 VM (SmolLM2's 49,152 x 576 head: 5-8 ms at one row, 31-53 ms at 16 as the
// VM drifts; this kernel 1.6-1.7x faster at one row, 1.2-1.6x at 16, measured back to back).
//
// How: threads split the output channels in groups of O (whole weight rows, contiguous memory).
// Within a group every pass of R input rows meets the group's O weight rows while they sit in L1,
// so the weight is read from memory once per call whatever the row count. A pass converts each
// 8 or 16 int8 weights to fp32 once (sign-extend, convert: exact) for its R rows, one vector
// accumulator per (row, output) with fused multiply-adds in input order; the lanes are folded at
// the end (simd::reduce_add) and the sum scaled by the channel's scale.
//
// Numerics: every output is the same chain of operations whatever the row count, the row's place
// in the batch, O, R and the thread split, so the kernel is batch-invariant (tested bitwise). The
// order of the K products differs from torch's kernel within fp32 rounding of a K-term dot
// product; tests/tiers/kernels/test_cpu_kernels.py checks it against an fp64 reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

namespace simd = tiered_router::simd;

// kLanes int8 weights as exact fp32 values.
#if defined(__AVX512F__)
inline simd::vf load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline simd::vf load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

struct Args {
  const float* x;   // [M, Kp] fp32, zero-padded to whole vectors
  const int8_t* w;  // [N, K]
  const float* scale;
  int64_t M, K, Kp, N;
  uint16_t* y;  // bf16 [M, N]
};

// Outputs [n0, n0 + O) of rows [m0, m0 + R). `wr` holds the group's weight rows, padded with
// zeros to Kp (the last vector of a row with K % kLanes != 0 reads the padding, as x does).
// `ahead`: weight bytes a few groups on, `ahead_lines` cache lines of them fetched one per step
// while this pass computes (0: none); the hardware prefetcher ramps up poorly on a group's short
// interleaved row streams.
template <int R, int O>
inline void pass(const Args& a, const int8_t* const* wr, int64_t n0, int64_t m0, const int8_t* ahead,
                 int64_t ahead_lines) {
  simd::vf acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = simd::zero();
  for (int64_t k = 0, line = 0; k < a.Kp; k += simd::kLanes, ++line) {
    if (line < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
    simd::vf wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load_i8(wr[o] + k);
    for (int r = 0; r < R; ++r) {
      const simd::vf xv = simd::load(a.x + (m0 + r) * a.Kp + k);
      for (int o = 0; o < O; ++o) acc[r][o] = simd::fmadd(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o)
      a.y[(m0 + r) * a.N + n0 + o] = tiered_router::float_to_bf16(simd::reduce_add(acc[r][o]) * a.scale[n0 + o]);
}

// Rows per pass: R * O accumulators + O weight vectors + one input vector within the register
// file (32 zmm on AVX512, 16 ymm on AVX2).
#if defined(__AVX512F__)
constexpr int kRows = 6;
constexpr int kOuts = 4;
#else
constexpr int kRows = 4;
constexpr int kOuts = 3;
#endif

// How far ahead the weight is fetched, in groups of kOuts rows (4 and 16 measured no better).
constexpr int64_t kAheadGroups = 8;

// Every row of the batch against one group's O weight rows; the first pass fetches ahead.
template <int O>
void group(const Args& a, const int8_t* const* wr, int64_t n0) {
  const int64_t next = n0 + kAheadGroups * kOuts;
  const int8_t* ahead = a.w + std::min(next, a.N - 1) * a.K;
  const int64_t lines = next < a.N ? (std::min<int64_t>(O, a.N - next) * a.K + 63) / 64 : 0;
  int64_t m = 0;
  for (; m + kRows <= a.M; m += kRows) pass<kRows, O>(a, wr, n0, m, ahead, m == 0 ? lines : 0);
  const int64_t first = m == 0 ? lines : 0;
  switch (a.M - m) {
    case 0: return;
    case 1: return pass<1, O>(a, wr, n0, m, ahead, first);
    case 2: return pass<2, O>(a, wr, n0, m, ahead, first);
    case 3: return pass<3, O>(a, wr, n0, m, ahead, first);
#if defined(__AVX512F__)
    case 4: return pass<4, O>(a, wr, n0, m, ahead, first);
    case 5: return pass<5, O>(a, wr, n0, m, ahead, first);
#endif
    default: TORCH_CHECK(false, "w8_linear: unreachable row tail");
  }
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "w8_linear: x must be 2-D bf16 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "w8_linear: weight must be int8 [out, in]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(),
              "w8_linear: CPU tensors only");
  TORCH_CHECK(x.size(1) == weight.size(1), "w8_linear: x has ", x.size(1), " inputs, weight ", weight.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0), "w8_linear: scale must be [out]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor w = weight.contiguous();
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  const at::Tensor xc = x.contiguous();
  const int64_t Kp = (K + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
  std::vector<float> xf(static_cast<size_t>(M * Kp), 0.0f);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * Kp + k] = tiered_router::bf16_to_float(xp[m * K + k]);
  const Args a{xf.data(), w.data_ptr<int8_t>(), s.data_ptr<float>(), M, K, Kp, N,
               reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>())};
  const int64_t groups = N / kOuts;
  // ~64 KB of weight per task: enough to amortise a task, fine enough for two threads to split a
  // 576-wide projection evenly.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K * kOuts, 1));
  const bool padded = Kp != K;
  at::parallel_for(0, groups + (N % kOuts != 0 ? 1 : 0), grain, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> pad(padded ? static_cast<size_t>(kOuts * Kp) : 0, 0);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kOuts;
      const int outs = static_cast<int>(std::min<int64_t>(kOuts, N - n0));
      const int8_t* wr[kOuts];
      for (int o = 0; o < outs; ++o) {
        wr[o] = a.w + (n0 + o) * K;
        if (padded) {
          std::memcpy(pad.data() + o * Kp, wr[o], static_cast<size_t>(K));
          wr[o] = pad.data() + o * Kp;
        }
      }
      if (outs == kOuts) {
        group<kOuts>(a, wr, n0);
      } else {
        for (int o = 0; o < outs; ++o) group<1>(a, wr + o, n0 + o);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("w8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) { m.impl("w8_linear", w8_linear); }
