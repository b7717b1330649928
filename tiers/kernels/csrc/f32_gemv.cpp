// fp32 linear for one or two rows, y = x @ w.T (+ bias), reading the weight in its own [out, in]
// layout at the memory's speed.
//
// Why: at one or two rows (a single stream's decode step without drafts, two streams) an fp32
// projection is bound by reading its weight, 4 bytes per multiply-add. oneDNN's packed GEMM, which
// serves the fp32 tier's projections otherwise (tiers/layers/quantization/quant.py), streams SmolLM2-135M's weights at
// ~21-23 GB/s at those row counts on the 2-core AMD EPYC Zen 4 VM, against ~32 GB/s from 3 rows:
// its one-row path leaves a third of the bandwidth unused, and a 135M fp32 step reads 540 MB.
//
// How: threads split the output channels in groups of O (whole weight rows, contiguous memory);
// a pass takes R input rows against one group with one vector accumulator per (input row,
// output), fused multiply-adds in input order, and folds the lanes at the end (simd::reduce_add)
// before adding the bias. O is as large as the register file allows for R (R * O accumulators + O
// weight vectors + one input vector), so each input vector meets as many weight streams as
// possible; the next group's rows are prefetched while one group computes. Past kMaxRows rows the
// weight is streamed again per pass: this kernel is for a few rows.
//
// Numerics: every output is the same chain of operations whatever the row count, the row's place
// in the batch, O and the thread split, so the kernel is batch-invariant (tested bitwise). The
// order differs from oneDNN's (lane-interleaved partial sums, one rounding per FMA) within fp32
// rounding of a K-term dot product; tests/tiers/kernels/test_cpu_kernels.py checks it against fp64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>
#include <optional>

namespace {

namespace simd = tiered_router::simd;

struct Args {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t K, kv, N;  // kv: K rounded down to whole vectors
  float* y;
  const float* bias;
};

// Outputs [n0, n0 + O) of rows [m0, m0 + R): one vector accumulator per (row, output), fused
// multiply-adds in input order, a masked tail for the last K % kLanes inputs (zero-padded, so the
// same FMA into the same lanes), lanes folded by simd::reduce_add, then the bias. Every output is
// this same chain whatever R, O and the thread that runs it: that is the batch invariance.
template <int R, int O>
inline void group(const Args& a, int64_t n0, int64_t m0) {
  simd::vf acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = simd::zero();
  const float* wr[O];
  for (int o = 0; o < O; ++o) wr[o] = a.w + (n0 + o) * a.K;
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = a.x + (m0 + r) * a.ldx;
  // The next group's rows are the next O * K floats: fetch them while this one computes. Each
  // group's rows are short streams (2-6 KB) that the hardware prefetcher barely ramps up on.
  const float* next = a.w + (n0 + O) * a.K;
  for (int64_t k = 0; k < a.kv; k += simd::kLanes) {
    for (int o = 0; o < O; ++o) _mm_prefetch(reinterpret_cast<const char*>(next + o * a.K + k), _MM_HINT_T0);
    simd::vf wv[O];
    for (int o = 0; o < O; ++o) wv[o] = simd::load(wr[o] + k);
    for (int r = 0; r < R; ++r) {
      const simd::vf xv = simd::load(xr[r] + k);
      for (int o = 0; o < O; ++o) acc[r][o] = simd::fmadd(xv, wv[o], acc[r][o]);
    }
  }
  if (a.kv < a.K) {
    const int64_t tail = a.K - a.kv;
    simd::vf wv[O];
    for (int o = 0; o < O; ++o) wv[o] = simd::load_first(wr[o] + a.kv, tail);
    for (int r = 0; r < R; ++r) {
      const simd::vf xv = simd::load_first(xr[r] + a.kv, tail);
      for (int o = 0; o < O; ++o) acc[r][o] = simd::fmadd(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      const float s = simd::reduce_add(acc[r][o]);
      a.y[(m0 + r) * a.N + n0 + o] = a.bias != nullptr ? s + a.bias[n0 + o] : s;
    }
}

// Rows [m0, m0 + R) against every output: groups of O over the threads, the N % O left after.
template <int R, int O>
void rows(const Args& a, int64_t m0) {
  const int64_t groups = a.N / O;
  // ~64 KB of weight per task at the smallest: enough to amortise a task, fine enough for two
  // threads to split a 576-wide projection evenly.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(a.K * O / 4, 1));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group<R, O>(a, g * O, m0);
  });
  for (int64_t n = groups * O; n < a.N; ++n) group<R, 1>(a, n, m0);
}

// Outputs per group for R rows in one pass: R * O accumulators + O weight vectors + one input
// vector within the register file (32 zmm on AVX512, 16 ymm on AVX2); more outputs per group
// means more weight streams in flight per input vector.
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 8;
void rows_pass(const Args& a, int64_t m0, int64_t r) {
  switch (r) {
    case 1: return rows<1, 8>(a, m0);
    case 2: return rows<2, 8>(a, m0);
    case 3: return rows<3, 6>(a, m0);
    case 4: return rows<4, 6>(a, m0);
    case 5: return rows<5, 4>(a, m0);
    case 6: return rows<6, 4>(a, m0);
    case 7: return rows<7, 3>(a, m0);
    default: return rows<8, 3>(a, m0);
  }
}
#else
constexpr int64_t kMaxRows = 4;
void rows_pass(const Args& a, int64_t m0, int64_t r) {
  switch (r) {
    case 1: return rows<1, 6>(a, m0);
    case 2: return rows<2, 4>(a, m0);
    case 3: return rows<3, 3>(a, m0);
    default: return rows<4, 2>(a, m0);
  }
}
#endif

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "f32_linear: x [rows, in] and weight [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "f32_linear: float32 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "f32_linear: CPU tensors only");
  TORCH_CHECK(x.size(1) == weight.size(1), "f32_linear: x has ", x.size(1), " inputs, weight ", weight.size(1));
  TORCH_CHECK(x.stride(1) == 1, "f32_linear: x rows must be contiguous");
  const at::Tensor w = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor b;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "f32_linear: bias must be float32 [out]");
    bptr = b.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Args a{x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), K, K - K % simd::kLanes, N,
               y.data_ptr<float>(), bptr};
  // Past kMaxRows the weight is streamed once per pass: this kernel is for a few rows.
  for (int64_t m = 0; m < M; m += kMaxRows) rows_pass(a, m, std::min(kMaxRows, M - m));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) { m.impl("f32_linear", f32_linear); }
