// Fused residual add + RMSNorm for the fast decoder path, bitwise equal to the torch ops it
// replaces: `h + delta` (one rounding to h's dtype), then HF's
// `weight * F.rms_norm(h.float(), (H,), eps).to(h.dtype)`.
//
// Why: on the CPU `F.rms_norm` is a composite of about eight ops (pow, sum, div_, add_, rsqrt,
// mul, casts); for one 576-wide row it measured 18 us, and a small model's decode step runs 61 of
// them - about a tenth of the step. One pass here does the same arithmetic in ~1 us.
//
// Bitwise contract, per row (tests/tiers/kernels/test_cpu_kernels.py checks it against the torch ops):
// - the mean of squares sums x*x in the order of torch's CPU `sum` (SumKernel.cpp, which runs its
//   AVX2 build on AVX512 hosts: 8-lane vectors, four interleaved partial sums in a 4-level
//   cascade, lanes folded left into the scalar tail's sum), then divides by H;
// - rstd = 1 / sqrt(mean + eps) in fp32, y = x * rstd, rounded to the activation dtype, then
//   weight * y with one rounding.
// Rows are independent, so splitting them over threads changes nothing (the tests run 1 and 2
// threads, rows 1 to 40000 wide).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using tiered_router::bf16_to_float;
using tiered_router::float_to_bf16;

// torch registers its AVX2 sum kernel for AVX512 hosts too (it measured faster), so the order to
// reproduce is that of 8-lane vectors.
constexpr int64_t kLanes = 8;

inline __m256 square8(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  return _mm256_mul_ps(v, v);
}

// torch's multi_row_sum<_, 4> over `size` groups of four vectors (group i holds vectors 4i..4i+3).
inline void cascade4(const float* x, int64_t size, __m256 out[4]) {
  constexpr int kLevels = 4;
  const int64_t ceil_log2 = size > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(size) - 1) : 0;
  const int64_t power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t step = int64_t(1) << power;
  const int64_t mask = step - 1;
  __m256 acc[kLevels][4];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square8(x + (i * 4 + k) * kLanes));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square8(x + (i * 4 + k) * kLanes));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

// The scalar twin for rows shorter than one vector (torch's scalar_inner_sum): at most one group
// of four, so the cascade's level loop never runs and each partial is one square.
inline float cascade4_scalar(const float* x, int64_t n) {
  const int64_t size = n / 4;
  float p[4] = {};
  for (int64_t i = 0; i < size; ++i)
    for (int k = 0; k < 4; ++k) p[k] += x[i * 4 + k] * x[i * 4 + k];
  for (int64_t t = size * 4; t < n; ++t) p[0] += x[t] * x[t];
  return ((p[0] + p[1]) + p[2]) + p[3];
}

float sum_of_squares(const float* x, int64_t n) {
  if (n < kLanes) return 0.0f + cascade4_scalar(x, n);
  const int64_t vecs = n / kLanes, groups = vecs / 4;
  __m256 part[4];
  cascade4(x, groups, part);
  for (int64_t v = groups * 4; v < vecs; ++v) part[0] = _mm256_add_ps(part[0], square8(x + v * kLanes));
  for (int k = 1; k < 4; ++k) part[0] = _mm256_add_ps(part[0], part[k]);
  float total = 0.0f;
  for (int64_t t = vecs * kLanes; t < n; ++t) total += x[t] * x[t];
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, part[0]);
  for (float lane : lanes) total += lane;
  return total;
}

// One row: optional residual add, then the norm. `xf` is scratch of H floats.
template <bool kBf16>
void norm_row(const void* h, const void* delta, const void* w, void* h_out, void* y_out, int64_t H, float eps,
              float* xf) {
  for (int64_t i = 0; i < H; ++i) {
    float v;
    if constexpr (kBf16) {
      v = bf16_to_float(static_cast<const uint16_t*>(h)[i]);
      if (delta) {
        v = bf16_to_float(float_to_bf16(v + bf16_to_float(static_cast<const uint16_t*>(delta)[i])));
        static_cast<uint16_t*>(h_out)[i] = float_to_bf16(v);
      }
    } else {
      v = static_cast<const float*>(h)[i];
      if (delta) {
        v = v + static_cast<const float*>(delta)[i];
        static_cast<float*>(h_out)[i] = v;
      }
    }
    xf[i] = v;
  }
  const float mean = sum_of_squares(xf, H) / static_cast<float>(H);
  const float rstd = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < H; ++i) {
    const float y = xf[i] * rstd;
    if constexpr (kBf16) {
      const float yb = bf16_to_float(float_to_bf16(y));
      const float wb = bf16_to_float(static_cast<const uint16_t*>(w)[i]);
      static_cast<uint16_t*>(y_out)[i] = float_to_bf16(wb * yb);
    } else {
      static_cast<float*>(y_out)[i] = static_cast<const float*>(w)[i] * y;
    }
  }
}

// Strided inputs are copied once (.contiguous() is free when they already are); the dtypes must
// match, as the bitwise contract is for one activation dtype.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& h_in,
                                                     const c10::optional<at::Tensor>& delta_in,
                                                     const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(h_in.dim() == 2, "add_rms_norm: h must be 2-D");
  const at::Tensor h = h_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const bool has_delta = delta_in.has_value() && delta_in->defined();
  const at::Tensor delta = has_delta ? delta_in->contiguous() : at::Tensor();
  const auto dtype = h.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "add_rms_norm: h must be bf16 or fp32");
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 1 && weight.size(0) == h.size(1),
              "add_rms_norm: weight must be [H] of h's dtype");
  const int64_t N = h.size(0), H = h.size(1);
  if (has_delta)
    TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == dtype, "add_rms_norm: delta must match h");
  // Without a delta h is unchanged; returning it would alias an input the schema says is not
  // aliased, so the first output is left undefined (None in Python).
  at::Tensor h_out = has_delta ? at::empty_like(h) : at::Tensor();
  at::Tensor y = at::empty_like(h);
  const auto esz = h.element_size();
  const char* hp = static_cast<const char*>(h.data_ptr());
  const char* dp = has_delta ? static_cast<const char*>(delta.data_ptr()) : nullptr;
  char* hop = has_delta ? static_cast<char*>(h_out.data_ptr()) : nullptr;
  char* yp = static_cast<char*>(y.data_ptr());
  const void* wp = weight.data_ptr();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(H));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t off = r * H * esz;
      if (dtype == at::kBFloat16)
        norm_row<true>(hp + off, dp ? dp + off : nullptr, wp, hop ? hop + off : nullptr, yp + off, H, feps, xf.data());
      else
        norm_row<false>(hp + off, dp ? dp + off : nullptr, wp, hop ? hop + off : nullptr, yp + off, H, feps, xf.data());
    }
  });
  return {h_out, y};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("add_rms_norm(Tensor h, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_impl);
}
