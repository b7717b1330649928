// Causal attention of a few query tokens per sequence, read straight from the paged KV pool.
//
// Why: a decode step of a 30-layer model runs attention 30 times for one new token per sequence.
// The generic route gathers every row's blocks into a dense [rows, kv_len, ...] copy
// (index_select), casts and transposes it, and calls torch's flash kernel, which is built for long
// query blocks: ~35 us per layer for one token over 120 keys, ~300 us for 16 rows - a tenth to a
// fifth of the step, nearly all of it overhead. Here each (query token, KV head) walks its own
// visible keys through the block table, once for all query heads of its GQA group.
//
// Arithmetic (not bitwise equal to torch's flash kernel, whose blocking and bf16 rounding of the
// probabilities differ; tests compare against an fp64 reference and the SDPA path):
// scores s_j = (q . k_j) * scale in fp32, softmax in fp32 with the row max subtracted, the output
// sum_j p_j v_j accumulated in fp32 and divided by sum_j p_j, rounded once to the output dtype.
// Query token t of a row at start position s sees keys 0..s+t (the row's earlier context plus the
// tokens written by this forward up to itself), so no mask tensor is built or read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

namespace simd = tiered_router::simd;
using simd::kLanes;
using simd::vf;

constexpr int64_t kMaxGroup = 8;     // query heads per KV head held in registers

struct Geometry {
  int64_t block_size, kv_heads, dim, group, q_len, table_width;
  int64_t q_tok_stride, q_head_stride;  // elements
  float scale;
};

// One (query token, KV head): its `group` query heads against keys 0..visible-1.
// `scores` is scratch of group * visible floats.
// G and DV (head_dim / lanes) are compile-time so the query and accumulator tiles stay in
// registers (on AVX2's 16 registers the larger tiles spill to L1, which still beats a gather).
template <typename TQ, typename TKV, int G, int DV>
void attend(const TQ* q, const TKV* pool, const int64_t* table, int64_t visible, const Geometry& g, TQ* out,
            int64_t kv_head, float* scores) {
  constexpr int64_t dv = DV;
  const int64_t token_stride = 2 * g.kv_heads * g.dim;  // pool elements per position
  vf qv[G][DV];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < dv; ++d) qv[h][d] = simd::load(q + h * g.q_head_stride + d * kLanes);
  auto key_at = [&](int64_t j) {
    const int64_t block = table[j / g.block_size];
    return pool + (block * g.block_size + j % g.block_size) * token_stride + kv_head * g.dim;
  };
  // Scores, one fp32 dot product per head and key. Keys go kU at a time: their dot products and
  // lane reductions are independent chains the core overlaps (one key at a time, each reduction
  // waited for the last FMA). Every score is the same chain of operations either way.
  constexpr int kU = DV <= 4 ? 4 : 2;
  float top[G];
  for (int64_t h = 0; h < G; ++h) top[h] = -INFINITY;
  int64_t j0 = 0;
  for (; j0 + kU <= visible; j0 += kU) {
    vf kv[kU][DV];
    for (int u = 0; u < kU; ++u) {
      const TKV* k = key_at(j0 + u);
      for (int64_t d = 0; d < dv; ++d) kv[u][d] = simd::load(k + d * kLanes);
    }
    for (int64_t h = 0; h < G; ++h) {
      float s[kU];
      for (int u = 0; u < kU; ++u) {
        vf acc = simd::mul(qv[h][0], kv[u][0]);
        for (int64_t d = 1; d < dv; ++d) acc = simd::fmadd(qv[h][d], kv[u][d], acc);
        s[u] = simd::reduce_add(acc) * g.scale;
      }
      for (int u = 0; u < kU; ++u) {
        scores[h * visible + j0 + u] = s[u];
        top[h] = std::max(top[h], s[u]);
      }
    }
  }
  for (int64_t j = j0; j < visible; ++j) {
    const TKV* k = key_at(j);
    vf kv[DV];
    for (int64_t d = 0; d < dv; ++d) kv[d] = simd::load(k + d * kLanes);
    for (int64_t h = 0; h < G; ++h) {
      vf acc = simd::mul(qv[h][0], kv[0]);
      for (int64_t d = 1; d < dv; ++d) acc = simd::fmadd(qv[h][d], kv[d], acc);
      const float s = simd::reduce_add(acc) * g.scale;
      scores[h * visible + j] = s;
      top[h] = std::max(top[h], s);
    }
  }
  // Probabilities (unnormalised) and their sums.
  float total[G];
  for (int64_t h = 0; h < G; ++h) {
    float* s = scores + h * visible;
    const vf mx = simd::set1(top[h]);
    vf sum = simd::zero();
    int64_t j = 0;
    for (; j + kLanes <= visible; j += kLanes) {
      const vf p = simd::exp_nonpositive(simd::sub(simd::load(s + j), mx));
      simd::store(s + j, p);
      sum = simd::add(sum, p);
    }
    if (j < visible) {  // the tail: lanes past it load as 0 and are masked out of the sum
      const int64_t n = visible - j;
      const vf p = simd::exp_nonpositive(simd::sub(simd::load_first(s + j, n), mx));
      simd::store_first(s + j, p, n);
      alignas(64) float lanes[kLanes];
      simd::store(lanes, p);
      for (int64_t e = n; e < kLanes; ++e) lanes[e] = 0.0f;
      sum = simd::add(sum, simd::load(lanes));
    }
    total[h] = simd::reduce_add(sum);
  }
  // Weighted values: each V row is loaded once for all heads of the group.
  vf acc[G][DV];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < dv; ++d) acc[h][d] = simd::zero();
  for (int64_t j = 0; j < visible; ++j) {
    const TKV* v = key_at(j) + g.kv_heads * g.dim;
    vf vv[DV];
    for (int64_t d = 0; d < dv; ++d) vv[d] = simd::load(v + d * kLanes);
    for (int64_t h = 0; h < G; ++h) {
      const vf p = simd::set1(scores[h * visible + j]);
      for (int64_t d = 0; d < dv; ++d) acc[h][d] = simd::fmadd(p, vv[d], acc[h][d]);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const vf inv = simd::set1(1.0f / total[h]);
    alignas(64) float row[kLanes];
    for (int64_t d = 0; d < dv; ++d) {
      simd::store(row, simd::mul(acc[h][d], inv));
      TQ* o = out + h * g.dim + d * kLanes;
      for (int64_t e = 0; e < kLanes; ++e) o[e] = tiered_router::from_float<TQ>(row[e]);
    }
  }
}

template <typename TQ, typename TKV, int G, int DV>
void run(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& starts,
         at::Tensor& out, const Geometry& g) {
  const auto* qp = reinterpret_cast<const TQ*>(q.data_ptr());
  const auto* pp = reinterpret_cast<const TKV*>(pool.data_ptr());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  auto* op = reinterpret_cast<TQ*>(out.data_ptr());
  const int64_t tokens = q.size(0), heads = g.kv_heads * g.group;
  const int64_t items = tokens * g.kv_heads;
  // Split over threads only when a chunk holds enough multiply-adds to pay for the handoff
  // (~a few us): one decode token over ~100 keys stays on the calling thread.
  const int64_t visible_hint = sp[0] + g.q_len;
  const int64_t work = std::max<int64_t>(1, visible_hint * g.group * g.dim * 2);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / work);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t m = it / g.kv_heads, kvh = it % g.kv_heads;
      const int64_t row = m / g.q_len, t = m % g.q_len;
      const int64_t visible = sp[row] + t + 1;
      scores.resize(static_cast<size_t>(g.group * visible));
      attend<TQ, TKV, G, DV>(qp + m * g.q_tok_stride + kvh * g.group * g.q_head_stride, pp, tp + row * g.table_width,
                      visible, g, op + (m * heads + kvh * g.group) * g.dim, kvh, scores.data());
    }
  });
}

template <typename TQ, typename TKV, int G>
void run_dim(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& starts,
             at::Tensor& out, const Geometry& g) {
  // head_dim 16, 32, 64 or 128 in vectors of kLanes (16 on AVX512, 8 on AVX2).
  switch (g.dim / kLanes) {
    case 1: return run<TQ, TKV, G, 1>(q, pool, table, starts, out, g);
    case 2: return run<TQ, TKV, G, 2>(q, pool, table, starts, out, g);
    case 4: return run<TQ, TKV, G, 4>(q, pool, table, starts, out, g);
    case 8: return run<TQ, TKV, G, 8>(q, pool, table, starts, out, g);
#if !defined(__AVX512F__)
    case 16: return run<TQ, TKV, G, 16>(q, pool, table, starts, out, g);
#endif
    default: TORCH_CHECK(false, "paged_attention: head_dim ", g.dim, " is not 16, 32, 64 or 128");
  }
}

template <typename TQ, typename TKV>
void run_group(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& starts,
               at::Tensor& out, const Geometry& g) {
  switch (g.group) {
    case 1: return run_dim<TQ, TKV, 1>(q, pool, table, starts, out, g);
    case 2: return run_dim<TQ, TKV, 2>(q, pool, table, starts, out, g);
    case 3: return run_dim<TQ, TKV, 3>(q, pool, table, starts, out, g);
    case 4: return run_dim<TQ, TKV, 4>(q, pool, table, starts, out, g);
    case 5: return run_dim<TQ, TKV, 5>(q, pool, table, starts, out, g);
    case 6: return run_dim<TQ, TKV, 6>(q, pool, table, starts, out, g);
    case 7: return run_dim<TQ, TKV, 7>(q, pool, table, starts, out, g);
    case 8: return run_dim<TQ, TKV, 8>(q, pool, table, starts, out, g);
    default: TORCH_CHECK(false, "paged_attention: ", g.group, " query heads per KV head (at most 8)");
  }
}

// q: [rows * q_len, heads, dim] (token-major, rows in order; last dim contiguous), pool: one
// layer's [blocks, block_size, 2, kv_heads, dim], block_table: [rows, width] int64 (the first
// blocks cover each row's visible keys), starts: [rows] int64 position of each row's first query.
at::Tensor paged_attention_impl(const at::Tensor& q, const at::Tensor& pool_in, const at::Tensor& block_table_in,
                                const at::Tensor& starts_in, int64_t q_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [tokens, heads, dim], dim contiguous");
  TORCH_CHECK(pool_in.dim() == 5 && pool_in.size(2) == 2, "paged_attention: pool must be [blocks, bs, 2, kvh, dim]");
  const at::Tensor pool = pool_in.contiguous();
  const at::Tensor table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor starts = starts_in.to(at::kLong).contiguous();
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool.size(3), rows = table.size(0);
  TORCH_CHECK(pool.size(4) == dim, "paged_attention: pool head_dim ", pool.size(4), " != q's ", dim);
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128,
              "paged_attention: head_dim must be 16, 32, 64 or 128, not ", dim);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "paged_attention: heads per KV head must be <= 8");
  TORCH_CHECK(q_len >= 1 && tokens == rows * q_len, "paged_attention: q holds ", tokens, " tokens, not rows * q_len");
  TORCH_CHECK(starts.numel() == rows, "paged_attention: one start per row");
  const auto qt = q.scalar_type(), kt = pool.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "paged_attention: q must be fp32 or bf16");
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16, "paged_attention: pool must be fp32 or bf16");
  const int64_t width = table.size(1), bs = pool.size(1);
  const auto* sp = starts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] + q_len <= width * bs, "paged_attention: row ", r, " sees past its block table");
    // A block index outside the pool would read foreign memory: check the ones this row reads.
    const int64_t* tr = table.data_ptr<int64_t>() + r * width;
    for (int64_t b = 0; b < (sp[r] + q_len + bs - 1) / bs; ++b)
      TORCH_CHECK(tr[b] >= 0 && tr[b] < pool.size(0), "paged_attention: row ", r, " block ", b, " is ", tr[b],
                  ", outside the pool");
  }
  at::Tensor out = at::empty({tokens, heads, dim}, q.options());
  if (tokens == 0) return out;
  const Geometry g{bs, kv_heads, dim, heads / kv_heads, q_len, width, q.stride(0), q.stride(1),
                   static_cast<float>(scale)};
  if (qt == at::kBFloat16 && kt == at::kBFloat16)
    run_group<uint16_t, uint16_t>(q, pool, table, starts, out, g);
  else if (qt == at::kBFloat16)
    run_group<uint16_t, float>(q, pool, table, starts, out, g);
  else if (kt == at::kBFloat16)
    run_group<float, uint16_t>(q, pool, table, starts, out, g);
  else
    run_group<float, float>(q, pool, table, starts, out, g);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_router, m) {
  m.def("paged_attention(Tensor q, Tensor pool, Tensor block_table, Tensor starts, int q_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_router, CPU, m) {
  m.impl("paged_attention", &paged_attention_impl);
}
