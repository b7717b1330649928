// Rotary embedding of q and k plus the KV-cache write of one layer, in one pass, bitwise equal to
// the torch ops it replaces on the fast path (tiers/models/llama.py):
//   qk  = qkv[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
//   rot = qk * cos + cat(qk[..., half:], qk[..., :half]) * signed_sin   (HF's rotate_half, with
//         the sign of its first half folded into signed_sin)
//   pool.view(-1, 2, kv_heads, dim)[slots] = stack(rot[:, heads:], v)    (v = the rest of qkv)
//   return rot[:, :heads]
//
// Why: at one decode row those are ~12 small torch ops per layer (slices, two muls, a cat, an add,
// a stack, an index_copy_ and their views), ~10 us each of dispatch on a 2-core VM: ~3 ms of a
// ~27 ms step of SmolLM2-135M, for a few thousand multiplies.
//
// Bitwise contract: each product and the sum are rounded to the activation dtype as torch's
// elementwise ops do (bf16: computed in fp32 from the bf16 inputs, rounded to nearest-even; fp32:
// separate multiply and add, no FMA - the build passes -ffp-contract=off), and K/V are copied to the
// pool unchanged (the pool has the model's dtype). tests/tiers/kernels/test_cpu_kernels.py compares q and
// the whole pool against the torch ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"

#include <cstdint>
#include <cstring>

namespace {

using tiered_router::from_float;
using tiered_router::to_float;

// One head's `dim` values of token row `x` rotated into `out`.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const int64_t r = d < half ? d + half : d - half;  // cat(x[half:], x[:half])[d]
    // Each product rounded to T, as torch's elementwise mul returns it, then the sum.
    const float a = to_float(from_float<T>(to_float(x[d]) * to_float(cos[d])));
    const float b = to_float(from_float<T>(to_float(x[r]) * to_float(sin[d])));
    out[d] = from_float<T>(a + b);
  }
}

template <typename T>
void run(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pool, const at::Tensor& slots,
         int64_t heads, int64_t kv_heads, int64_t dim, at::Tensor& q) {
  const int64_t n = qkv.size(0), width = qkv.size(1);
  const auto* xp = reinterpret_cast<const T*>(qkv.data_ptr());
  const auto* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const T*>(sin.data_ptr());
  auto* pp = reinterpret_cast<T*>(pool.data_ptr());
  auto* qp = reinterpret_cast<T*>(q.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t per_slot = 2 * kv_heads * dim;  // pool elements per position: K then V
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = xp + t * width;
      const T* c = cp + t * dim;
      const T* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * dim, c, s, dim, qp + (t * heads + h) * dim);
      T* kv = pp + slot[t] * per_slot;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(x + (heads + h) * dim, c, s, dim, kv + h * dim);
      std::memcpy(kv + kv_heads * dim, x + (heads + kv_heads) * dim, sizeof(T) * kv_heads * dim);
    }
  });
}

// qkv: [n, (heads + 2 kv_heads) * dim] row-major; cos, signed_sin: [n, dim]; pool: one layer's
// [blocks, block_size, 2, kv_heads, dim]; slots: [n] int64 position (block * block_size + offset).
// Returns q rotated, [n, heads, dim].
at::Tensor rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pool,
                         const at::Tensor& slots_in, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_kv_write: qkv must be a contiguous [n, width]");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "rope_kv_write: qkv must be bf16 or fp32");
  TORCH_CHECK(pool.dim() == 5 && pool.size(2) == 2 && pool.size(3) == kv_heads && pool.is_contiguous(),
              "rope_kv_write: pool must be a contiguous [blocks, block_size, 2, kv_heads, dim]");
  const int64_t n = qkv.size(0), dim = pool.size(4);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rope_kv_write: qkv width ", qkv.size(1), " is not (heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(pool.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rope_kv_write: cos, sin and the pool must have qkv's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * dim && sin.numel() == n * dim,
              "rope_kv_write: cos and sin must be contiguous [n, head_dim]");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == n, "rope_kv_write: one slot per token");
  const int64_t positions = pool.size(0) * pool.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)  // a slot outside the pool would write foreign memory
    TORCH_CHECK(sp[t] >= 0 && sp[t] < positions, "rope_kv_write: slot ", sp[t], " is outside the pool");
  at::Tensor q = at::empty({n, heads, dim}, qkv.options());
  if (dtype == at::kBFloat16)
    run<uint16_t>(qkv, cos, sin, pool, slots, heads, kv_heads, dim, q);
  else
    run<float>(qkv, cos, sin, pool, slots, heads, kv_heads, dim, q);
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor slots, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) {
  m.impl("rope_kv_write", &rope_kv_write);
}
