// MoE routing/pruning and grouped dispatch (CPU): the dispatch reads only the experts that received at
// least one token.
#include "cpu_utils.h"
#include "gemv_rows.h"
#include "gemv_rows_bf16.h"
#include "ops.h"
#include "projection_path.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace sparsever::cpu {
namespace {

template <typename scalar_t>
int64_t moe_dispatch_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& topk_weights,
                          const torch::Tensor& topk_ids, const torch::Tensor& w13, const torch::Tensor& w2) {
  const int64_t num_tokens = x.size(0), h = x.size(1), k = topk_ids.size(1);
  const int64_t num_experts = w13.size(0), inter = w13.size(1) / 2;
  auto ids_t = topk_ids.to(torch::kLong).contiguous();
  auto wts_t = topk_weights.to(torch::kFloat).contiguous();
  auto xf_t = x.to(torch::kFloat).contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* wts = wts_t.data_ptr<float>();
  const float* xf = xf_t.data_ptr<float>();
  // Group (token, slot) pairs by expert: counting sort keeps token order within an expert.
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < num_tokens * k; ++i)
    if (ids[i] >= 0) {
      TORCH_CHECK(ids[i] < num_experts, "topk_ids out of range");
      ++count[ids[i] + 1];
    }
  std::partial_sum(count.begin(), count.end(), count.begin());
  std::vector<int64_t> pairs(count[num_experts]);
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t i = 0; i < num_tokens * k; ++i)
      if (ids[i] >= 0) pairs[fill[ids[i]]++] = i;
  }
  // Kept experts (at least one routed token); pruned/unrouted experts' weights are never read.
  struct Active {
    int64_t expert, ne, pair_begin, row_offset;  // row_offset: first row in the gathered token buffers
  };
  const int64_t gemm_from = gemm_from_for<scalar_t>(gemm_min_tokens());
  std::vector<Active> streamed, gemm;  // experts with few tokens stream their weights; busy ones use GEMMs
  int64_t total_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t ne = count[e + 1] - count[e];
    if (ne == 0) continue;
    (ne >= gemm_from ? gemm : streamed).push_back({e, ne, count[e], total_rows});
    total_rows += ne;
  }
  const int64_t used = static_cast<int64_t>(streamed.size() + gemm.size());
  std::vector<float> xe(static_cast<size_t>(total_rows * h)), gu(static_cast<size_t>(total_rows * 2 * inter)),
      hid(static_cast<size_t>(total_rows * inter)), y(static_cast<size_t>(total_rows * h));
  for (const Active& a : streamed)
    for (int64_t i = 0; i < a.ne; ++i)
      std::copy_n(xf + (pairs[a.pair_begin + i] / k) * h, h, xe.data() + (a.row_offset + i) * h);
  const scalar_t* w13p = w13.data_ptr<scalar_t>();
  const scalar_t* w2p = w2.data_ptr<scalar_t>();
  const int64_t n_streamed = static_cast<int64_t>(streamed.size());
  // bf16 weights on a CPU with AVX512-BF16: both projections dot bf16 activations with vdpbf16ps.
  const bool bf16_dot = std::is_same_v<scalar_t, c10::BFloat16> && use_bf16_dot();
  const bool spread = spread_prefetch();
  std::vector<c10::BFloat16> in_bf16;
  // One parallel region per projection over (expert, row chunk) tasks, so all streamed experts share
  // the threads and there is no per-expert synchronisation.
  auto run_projection = [&](int64_t rows_per_expert, int64_t in_dim, const scalar_t* wbase, int64_t w_expert_stride,
                            int64_t w_row_stride, const float* in, float* outbuf) {
    const int64_t chunk = rows_per_task(in_dim, sizeof(scalar_t));
    const int64_t per_expert = (rows_per_expert + chunk - 1) / chunk;
    if (bf16_dot) {  // the streamed experts' activations rounded to bf16 once, as a bf16 expert's input is
      in_bf16.resize(static_cast<size_t>(total_rows * in_dim));
      for (const Active& a : streamed)
        store_from_f32<c10::BFloat16>(in + a.row_offset * in_dim, in_bf16.data() + a.row_offset * in_dim,
                                      a.ne * in_dim);
    }
    at::parallel_for(0, n_streamed * per_expert, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const Active& a = streamed[task / per_expert];
        const int64_t r0 = (task % per_expert) * chunk, r1 = std::min(rows_per_expert, r0 + chunk);
        float* y = outbuf + a.row_offset * rows_per_expert;
        if (bf16_dot)
          rows_dot_range_bf16(in_bf16.data() + a.row_offset * in_dim, a.ne, in_dim,
                              reinterpret_cast<const c10::BFloat16*>(wbase + a.expert * w_expert_stride), w_row_stride,
                              nullptr, r0, r1, y, rows_per_expert, spread);
        else
          rows_dot_range<scalar_t>(in + a.row_offset * in_dim, a.ne, in_dim, wbase + a.expert * w_expert_stride,
                                   w_row_stride, nullptr, r0, r1, y, rows_per_expert);
      }
    });
  };
  if (n_streamed > 0) {
    run_projection(2 * inter, h, w13p, w13.stride(0), w13.stride(1), xe.data(), gu.data());
    for (const Active& a : streamed)
      for (int64_t i = a.row_offset; i < a.row_offset + a.ne; ++i)
        silu_mul(gu.data() + i * 2 * inter, gu.data() + i * 2 * inter + inter, hid.data() + i * inter, inter);
    run_projection(h, inter, w2p, w2.stride(0), w2.stride(1), hid.data(), y.data());
  }
  for (const Active& a : gemm) {
    std::vector<int64_t> tok(a.ne);
    for (int64_t i = 0; i < a.ne; ++i) tok[i] = pairs[a.pair_begin + i] / k;
    torch::Tensor tok_t = torch::from_blob(tok.data(), {a.ne}, torch::kLong);
    torch::Tensor g_u = at::linear(x.index_select(0, tok_t), w13[a.expert]).to(torch::kFloat).contiguous();
    torch::Tensor hid_t = torch::empty({a.ne, inter}, torch::kFloat);
    for (int64_t i = 0; i < a.ne; ++i)
      silu_mul(g_u.data_ptr<float>() + i * 2 * inter, g_u.data_ptr<float>() + i * 2 * inter + inter,
               hid_t.data_ptr<float>() + i * inter, inter);
    torch::Tensor y_e = at::linear(hid_t.to(x.scalar_type()), w2[a.expert]).to(torch::kFloat).contiguous();
    std::copy_n(y_e.data_ptr<float>(), a.ne * h, y.data() + a.row_offset * h);
  }
  std::vector<float> acc(static_cast<size_t>(num_tokens * h), 0.f);
  for (int64_t i = 0; i < total_rows; ++i) {
    const float w = wts[pairs[i]];
    float* dst = acc.data() + (pairs[i] / k) * h;
    const float* src = y.data() + i * h;
    for (int64_t c = 0; c < h; ++c) dst[c] += w * src[c];
  }
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t t = 0; t < num_tokens; ++t) store_from_f32<scalar_t>(acc.data() + t * h, op + t * h, h);
  return used;
}

}  // namespace
}  // namespace sparsever::cpu

void moe_route_and_prune_cpu(const torch::Tensor& router_logits, int64_t top_k, double prune_ratio,
                             const std::optional<torch::Tensor>& group_start_loc, int64_t expert_budget,
                             bool renormalize, torch::Tensor& topk_weights, torch::Tensor& topk_ids) {
  TORCH_CHECK(router_logits.dim() == 2, "router_logits must be [T, E]");
  const int64_t num_tokens = router_logits.size(0), num_experts = router_logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, E]");
  TORCH_CHECK(topk_weights.scalar_type() == torch::kFloat && topk_weights.is_contiguous() &&
                  topk_ids.scalar_type() == torch::kInt && topk_ids.is_contiguous(),
              "topk_weights fp32 and topk_ids int32, both contiguous");
  TORCH_CHECK(topk_weights.size(0) == num_tokens && topk_weights.size(1) == top_k &&
                  topk_ids.sizes() == topk_weights.sizes(),
              "topk_weights/topk_ids must be [T, top_k]");
  auto logits = router_logits.to(torch::kFloat).contiguous();
  auto probs_t = torch::softmax(logits, -1);
  const float* probs = probs_t.data_ptr<float>();
  float* wts = topk_weights.data_ptr<float>();
  int32_t* ids = topk_ids.data_ptr<int32_t>();
  const float ratio = static_cast<float>(prune_ratio);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> order(num_experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* p = probs + t * num_experts;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      const float top1 = p[order[0]];
      for (int64_t j = 0; j < top_k; ++j) {
        const bool drop = j > 0 && p[order[j]] < ratio * top1;
        ids[t * top_k + j] = drop ? -1 : order[j];
        wts[t * top_k + j] = drop ? 0.f : p[order[j]];
      }
    }
  });
  if (expert_budget > 0 && group_start_loc.has_value()) {
    auto gsl_t = group_start_loc->to(torch::kInt).contiguous();
    const int32_t* gsl = gsl_t.data_ptr<int32_t>();
    std::vector<float> mass(num_experts);
    std::vector<char> used(num_experts), allowed(num_experts);
    std::vector<int32_t> kept;
    for (int64_t g = 0; g + 1 < gsl_t.numel(); ++g) {
      std::fill(used.begin(), used.end(), 0);
      for (int64_t t = gsl[g]; t < gsl[g + 1]; ++t)
        for (int64_t j = 0; j < top_k; ++j)
          if (ids[t * top_k + j] >= 0) used[ids[t * top_k + j]] = 1;
      kept.clear();
      for (int64_t e = 0; e < num_experts; ++e)
        if (used[e]) kept.push_back(static_cast<int32_t>(e));
      if (static_cast<int64_t>(kept.size()) <= expert_budget) continue;
      std::fill(mass.begin(), mass.end(), 0.f);
      for (int64_t t = gsl[g]; t < gsl[g + 1]; ++t)
        for (int64_t e = 0; e < num_experts; ++e) mass[e] += probs[t * num_experts + e];
      std::partial_sort(kept.begin(), kept.begin() + expert_budget, kept.end(), [&](int32_t a, int32_t b) {
        return mass[a] > mass[b] || (mass[a] == mass[b] && a < b);
      });
      std::fill(allowed.begin(), allowed.end(), 0);
      for (int64_t i = 0; i < expert_budget; ++i) allowed[kept[i]] = 1;
      for (int64_t t = gsl[g]; t < gsl[g + 1]; ++t) {
        bool any = false;
        for (int64_t j = 0; j < top_k; ++j) {
          int32_t& id = ids[t * top_k + j];
          if (id >= 0 && !allowed[id]) {
            id = -1;
            wts[t * top_k + j] = 0.f;
          }
          any = any || id >= 0;
        }
        if (!any) {  // every expert of this token was cut: route it to its best budgeted expert
          const float* p = probs + t * num_experts;
          int32_t best = -1;
          for (int64_t i = 0; i < expert_budget; ++i) {
            const int32_t e = kept[i];
            if (best < 0 || p[e] > p[best] || (p[e] == p[best] && e < best)) best = e;
          }
          ids[t * top_k] = best;
          wts[t * top_k] = p[best];
        }
      }
    }
  }
  if (renormalize) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) sum += wts[t * top_k + j];
      for (int64_t j = 0; j < top_k; ++j) wts[t * top_k + j] /= sum;
    }
  }
}

void moe_grouped_dispatch_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& topk_weights,
                              const torch::Tensor& topk_ids, const torch::Tensor& w13, const torch::Tensor& w2,
                              torch::Tensor& num_experts_used) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && out.is_contiguous(), "x/out must be [T, H], out contiguous");
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == x.size(1) && w13.size(1) % 2 == 0 && w13.stride(2) == 1,
              "w13 must be [E, 2I, H] with contiguous rows");
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == w13.size(0) && w2.size(1) == x.size(1) &&
                  w2.size(2) == w13.size(1) / 2 && w2.stride(2) == 1,
              "w2 must be [E, H, I] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "x, out and weights must share a dtype");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights/topk_ids must be [T, K]");
  TORCH_CHECK(num_experts_used.numel() == 1 && num_experts_used.scalar_type() == torch::kInt,
              "num_experts_used must be a one-element int32 tensor");
  int64_t used = 0;
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "moe_grouped_dispatch_cpu", [&] {
    used = sparsever::cpu::moe_dispatch_impl<scalar_t>(out, x, topk_weights, topk_ids, w13, w2);
  });
  num_experts_used.fill_(used);
}
