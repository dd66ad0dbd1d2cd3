// MoE routing with pruning and grouped dispatch over the union of kept experts (semantics:
// reference.moe_route_and_prune and reference.moe_grouped_dispatch).
//
// Routing: one warp per token computes the softmax, picks the top-k by repeated warp argmax (lower expert id
// wins ties, as the reference's stable sort) and drops slots below prune_ratio * p_top1. With a budget, one
// CTA per group keeps the `budget` experts of largest summed probability among those it uses (block top-k).
// Dispatch: a counting sort groups the (token, slot) entries by expert, then each kept expert runs its
// gate/up GEMV and its down GEMV over its own entries only - bytes read scale with the distinct experts
// kept - and a combine sums each token's slots in slot order (deterministic).
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"
#include "topk.cuh"
#include "warp_dot.cuh"

namespace sparsever {
namespace kernels {

constexpr int kMoeMaxTopK = 32;
constexpr int kMoeRouteWarps = 4;
constexpr int kMoeGroupThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kMoeRouteWarps * kWarpSize)
    moe_route_kernel(const T* __restrict__ logits, int64_t logit_stride, int num_tokens, int num_experts,
                     int top_k, float prune_ratio, bool renormalize, float* __restrict__ probs,
                     float* __restrict__ topk_weights, int* __restrict__ topk_ids) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kMoeRouteWarps + warp;
  if (t >= num_tokens) return;
  const T* row = logits + int64_t(t) * logit_stride;
  float row_max = -INFINITY;
  for (int e = lane; e < num_experts; e += kWarpSize) row_max = fmaxf(row_max, to_float(row[e]));
  row_max = warp_reduce_max(row_max);
  float sum = 0.0f;
  for (int e = lane; e < num_experts; e += kWarpSize) sum += expf(to_float(row[e]) - row_max);
  const float inv_sum = 1.0f / warp_reduce_sum(sum);
  if (probs != nullptr)
    for (int e = lane; e < num_experts; e += kWarpSize)
      probs[int64_t(t) * num_experts + e] = expf(to_float(row[e]) - row_max) * inv_sum;

  int ids[kMoeMaxTopK];
  float weights[kMoeMaxTopK];
  for (int s = 0; s < top_k; ++s) {
    float best_p = -1.0f;
    int best_e = num_experts;
    for (int e = lane; e < num_experts; e += kWarpSize) {
      bool taken = false;
      for (int q = 0; q < s; ++q) taken |= ids[q] == e;
      const float pe = expf(to_float(row[e]) - row_max) * inv_sum;
      if (!taken && (pe > best_p || (pe == best_p && e < best_e))) {
        best_p = pe;
        best_e = e;
      }
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
      const float other_p = __shfl_xor_sync(kFullMask, best_p, offset);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, offset);
      if (other_p > best_p || (other_p == best_p && other_e < best_e)) {
        best_p = other_p;
        best_e = other_e;
      }
    }
    ids[s] = best_e;
    weights[s] = best_p;
  }
  float kept_sum = 0.0f;
  for (int s = 0; s < top_k; ++s) {
    if (s > 0 && weights[s] < prune_ratio * weights[0]) {
      ids[s] = -1;
      weights[s] = 0.0f;
    }
    kept_sum += weights[s];
  }
  if (lane == 0) {
    const float scale = renormalize ? 1.0f / kept_sum : 1.0f;
    for (int s = 0; s < top_k; ++s) {
      topk_ids[int64_t(t) * top_k + s] = ids[s];
      topk_weights[int64_t(t) * top_k + s] = weights[s] * scale;
    }
  }
}

// Per group: if more than `budget` distinct experts are kept, keep the `budget` with the largest summed
// probability over the group's tokens; tokens left without a slot take their best budgeted expert.
__global__ void __launch_bounds__(kMoeGroupThreads)
    moe_budget_kernel(const float* __restrict__ probs, int num_experts, int top_k,
                      const int* __restrict__ group_start_loc, int budget, float* __restrict__ topk_weights,
                      int* __restrict__ topk_ids) {
  __shared__ BlockTopkScratch topk_scratch;
  __shared__ int distinct;
  SV_DYNAMIC_SHARED(int, smem);
  int* flag = smem;                                                // [E] kept, later: in budget
  float* mass = reinterpret_cast<float*>(smem + num_experts);      // [E]
  int* chosen = smem + 2 * num_experts;                            // [budget]
  const int t0 = group_start_loc[blockIdx.x], t1 = group_start_loc[blockIdx.x + 1];
  if (t1 <= t0) return;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) flag[e] = 0;
  if (threadIdx.x == 0) distinct = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < (t1 - t0) * top_k; i += blockDim.x) {
    const int id = topk_ids[int64_t(t0) * top_k + i];
    if (id >= 0) flag[id] = 1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    if (flag[e]) atomicAdd(&distinct, 1);
  __syncthreads();
  if (distinct <= budget) return;  // block-uniform
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    float m = -INFINITY;
    if (flag[e]) {
      m = 0.0f;
      for (int t = t0; t < t1; ++t) m += probs[int64_t(t) * num_experts + e];
    }
    mass[e] = m;
  }
  __syncthreads();
  block_topk_ascending([&](int e) { return mass[e]; }, num_experts, budget, chosen, topk_scratch);
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) flag[e] = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < budget; j += blockDim.x) flag[chosen[j]] = 1;
  __syncthreads();
  for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    int* ids = topk_ids + int64_t(t) * top_k;
    float* w = topk_weights + int64_t(t) * top_k;
    bool any = false;
    for (int s = 0; s < top_k; ++s) {
      if (ids[s] >= 0 && !flag[ids[s]]) {
        ids[s] = -1;
        w[s] = 0.0f;
      }
      any |= ids[s] >= 0;
    }
    if (!any) {
      int best = -1;
      float best_p = -1.0f;
      for (int e = 0; e < num_experts; ++e) {
        const float pe = probs[int64_t(t) * num_experts + e];
        if (flag[e] && pe > best_p) {  // ascending scan: strict > keeps the lower id on ties
          best = e;
          best_p = pe;
        }
      }
      ids[0] = best;
      w[0] = best_p;
    }
  }
}

__global__ void moe_renormalize_kernel(int num_tokens, int top_k, float* __restrict__ topk_weights) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  float* w = topk_weights + int64_t(t) * top_k;
  float sum = 0.0f;
  for (int s = 0; s < top_k; ++s) sum += w[s];
  for (int s = 0; s < top_k; ++s) w[s] /= sum;
}

// ---- grouped dispatch -------------------------------------------------------------------------------

// Counting sort of the (token, slot) entries by expert in one CTA (verification-sized routing tables).
// Writes offsets [E+1], the ascending list of used experts, their count (also num_experts_used).
template <typename IdT>
__global__ void moe_sort_by_expert_kernel(const IdT* __restrict__ topk_ids, int num_entries, int num_experts,
                                          int* __restrict__ offsets, int* __restrict__ active,
                                          int* __restrict__ num_active, int* __restrict__ num_experts_used,
                                          int* __restrict__ sorted_entries) {
  SV_DYNAMIC_SHARED(int, cursor);  // [E]: counts, then insertion cursors
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cursor[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < num_entries; i += blockDim.x) {
    const int64_t id = int64_t(topk_ids[i]);
    if (id >= 0 && id < num_experts) atomicAdd(&cursor[id], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0, used = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int count = cursor[e];
      offsets[e] = running;
      cursor[e] = running;
      if (count > 0) active[used++] = e;
      running += count;
    }
    offsets[num_experts] = running;
    *num_active = used;
    *num_experts_used = used;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_entries; i += blockDim.x) {
    const int64_t id = int64_t(topk_ids[i]);
    if (id >= 0 && id < num_experts) sorted_entries[atomicAdd(&cursor[id], 1)] = i;
  }
}

// h[entry, i] = silu(x[token] . w13[e, i]) * (x[token] . w13[e, I + i]) for the entries routed to e.
template <typename T, int kVec>
__global__ void __launch_bounds__(kGemvThreads)
    moe_gate_up_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ w13, int64_t w13_stride_e,
                       int64_t w13_stride_row, int inter, int hidden, int top_k, const int* __restrict__ offsets,
                       const int* __restrict__ active, const int* __restrict__ num_active,
                       const int* __restrict__ sorted_entries, float* __restrict__ h) {
  if (int(blockIdx.y) >= *num_active) return;  // grid.y is the expert count bound; most CTAs exit here
  const int e = active[blockIdx.y];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int i0 = (blockIdx.x * kGemvWarps + warp) * kGemvRowsPerWarp;
  if (i0 >= inter) return;
  constexpr int kRows = 2 * kGemvRowsPerWarp;  // gate rows, then the matching up rows
  const T* rows[kRows];
  const T* we = w13 + int64_t(e) * w13_stride_e;
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) {
    const int i = min_of(i0 + r, inter - 1);
    rows[r] = we + int64_t(i) * w13_stride_row;
    rows[kGemvRowsPerWarp + r] = we + int64_t(inter + i) * w13_stride_row;
  }
  const int begin = offsets[e], end = offsets[e + 1];
  for (int b = begin; b < end; b += kGemvTokens) {
    const int ntok = min_of(kGemvTokens, end - b);
    const T* toks[kGemvTokens];
#pragma unroll
    for (int t = 0; t < kGemvTokens; ++t) toks[t] = x + int64_t(sorted_entries[b + min_of(t, ntok - 1)] / top_k) * x_stride;
    float acc[kRows][kGemvTokens];
    warp_dot_rows_tokens<kRows, kGemvTokens, kVec>(rows, toks, ntok, hidden, acc);
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
      for (int t = 0; t < kGemvTokens; ++t)
        if (lane == r * kGemvTokens + t && t < ntok && i0 + r < inter)
          h[int64_t(sorted_entries[b + t]) * inter + i0 + r] = silu(acc[r][t]) * acc[kGemvRowsPerWarp + r][t];
  }
}

// y[entry, j] = topk_weight[entry] * (w2[e, j] . h[entry]) for the entries routed to e.
template <typename T, int kVec>
__global__ void __launch_bounds__(kGemvThreads)
    moe_down_kernel(const float* __restrict__ h, const T* __restrict__ w2, int64_t w2_stride_e, int64_t w2_stride_row,
                    int inter, int hidden, const float* __restrict__ topk_weights, const int* __restrict__ offsets,
                    const int* __restrict__ active, const int* __restrict__ num_active,
                    const int* __restrict__ sorted_entries, float* __restrict__ y) {
  if (int(blockIdx.y) >= *num_active) return;
  const int e = active[blockIdx.y];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int j0 = (blockIdx.x * kGemvWarps + warp) * kGemvRowsPerWarp;
  if (j0 >= hidden) return;
  const T* rows[kGemvRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
    rows[r] = w2 + int64_t(e) * w2_stride_e + int64_t(min_of(j0 + r, hidden - 1)) * w2_stride_row;
  const int begin = offsets[e], end = offsets[e + 1];
  for (int b = begin; b < end; b += kGemvTokens) {
    const int ntok = min_of(kGemvTokens, end - b);
    const float* toks[kGemvTokens];
#pragma unroll
    for (int t = 0; t < kGemvTokens; ++t) toks[t] = h + int64_t(sorted_entries[b + min_of(t, ntok - 1)]) * inter;
    float acc[kGemvRowsPerWarp][kGemvTokens];
    warp_dot_rows_tokens<kGemvRowsPerWarp, kGemvTokens, kVec>(rows, toks, ntok, inter, acc);
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
      for (int t = 0; t < kGemvTokens; ++t)
        if (lane == r * kGemvTokens + t && t < ntok && j0 + r < hidden) {
          const int entry = sorted_entries[b + t];
          y[int64_t(entry) * hidden + j0 + r] = topk_weights[entry] * acc[r][t];
        }
  }
}

// out[t] = sum of the token's kept slots in slot order (zeros when none is kept).
template <typename T, typename IdT>
__global__ void moe_combine_kernel(const float* __restrict__ y, const IdT* __restrict__ topk_ids, int top_k,
                                   int hidden, T* __restrict__ out, int64_t out_stride) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < top_k; ++s)
      if (topk_ids[int64_t(t) * top_k + s] >= 0) v += y[(int64_t(t) * top_k + s) * hidden + c];
    out[int64_t(t) * out_stride + c] = from_float<T>(v);
  }
}

template <class Launcher>
void moe_route_and_prune_impl(const at::Tensor& router_logits, int64_t top_k, double prune_ratio,
                              const std::optional<at::Tensor>& group_start_loc, int64_t expert_budget,
                              bool renormalize, at::Tensor& topk_weights, at::Tensor& topk_ids,
                              const Launcher& launch) {
  TORCH_CHECK(router_logits.dim() == 2 && unit_stride(router_logits, 1), "router_logits must be [T, E], rows contiguous");
  const int64_t num_tokens = router_logits.size(0), num_experts = router_logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(num_experts, kMoeMaxTopK), "top_k must be in [1, min(E, ",
              kMoeMaxTopK, ")], got ", top_k);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == at::IntArrayRef({num_tokens, top_k}),
              "topk_weights must be contiguous fp32 [T, top_k]");
  check_int32(topk_ids, "topk_ids");
  TORCH_CHECK(topk_ids.is_contiguous() && topk_ids.sizes() == topk_weights.sizes(), "topk_ids must be contiguous [T, top_k]");
  check_same_device(router_logits, topk_weights, "topk_weights");
  check_same_device(router_logits, topk_ids, "topk_ids");
  const bool budgeted = expert_budget > 0 && group_start_loc.has_value();
  if (budgeted) {
    check_int32(*group_start_loc, "group_start_loc");
    TORCH_CHECK(group_start_loc->dim() == 1 && group_start_loc->is_contiguous(), "group_start_loc must be contiguous [G+1]");
    check_same_device(router_logits, *group_start_loc, "group_start_loc");
  }
  if (num_tokens == 0) return;
  at::Tensor probs;
  if (budgeted) probs = at::empty({num_tokens, num_experts}, router_logits.options().dtype(at::kFloat));
  SV_DISPATCH_FLOAT_TYPES(router_logits.scalar_type(), "moe_route_and_prune", [&] {
    launch(dim3(unsigned(div_up<int64_t>(num_tokens, kMoeRouteWarps))), dim3(kMoeRouteWarps * kWarpSize), 0,
           moe_route_kernel<scalar_t>, router_logits.data_ptr<scalar_t>(), router_logits.stride(0), int(num_tokens),
           int(num_experts), int(top_k), float(prune_ratio), renormalize && !budgeted,
           budgeted ? probs.data_ptr<float>() : nullptr, topk_weights.data_ptr<float>(), topk_ids.data_ptr<int>());
  });
  if (!budgeted) return;
  const int64_t num_groups = group_start_loc->numel() - 1;
  const int64_t budget = std::min(expert_budget, num_experts);
  if (num_groups > 0) {
    const size_t smem = size_t(2 * num_experts + budget) * sizeof(int);
    launch(dim3(unsigned(num_groups)), dim3(kMoeGroupThreads), smem, moe_budget_kernel, probs.data_ptr<float>(),
           int(num_experts), int(top_k), group_start_loc->data_ptr<int>(), int(budget),
           topk_weights.data_ptr<float>(), topk_ids.data_ptr<int>());
  }
  if (renormalize) {
    launch(dim3(unsigned(div_up<int64_t>(num_tokens, 128))), dim3(128), 0, moe_renormalize_kernel, int(num_tokens),
           int(top_k), topk_weights.data_ptr<float>());
  }
}

template <typename T, typename IdT, int kVec, class Launcher>
void launch_moe_dispatch(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_weights,
                         const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                         at::Tensor& num_experts_used, const Launcher& launch) {
  const int num_tokens = int(x.size(0)), hidden = int(x.size(1)), top_k = int(topk_ids.size(1));
  const int num_experts = int(w13.size(0)), inter = int(w13.size(1) / 2);
  const int num_entries = num_tokens * top_k;
  auto i32 = x.options().dtype(at::kInt);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor offsets = at::empty({num_experts + 1}, i32);
  at::Tensor active = at::empty({num_experts}, i32);
  at::Tensor num_active = at::empty({1}, i32);
  at::Tensor sorted = at::empty({std::max(num_entries, 1)}, i32);
  at::Tensor h = at::empty({num_entries, inter}, f32);
  at::Tensor y = at::empty({num_entries, hidden}, f32);
  launch(dim3(1), dim3(1024), size_t(num_experts) * sizeof(int), moe_sort_by_expert_kernel<IdT>,
         topk_ids.data_ptr<IdT>(), num_entries, num_experts, offsets.data_ptr<int>(), active.data_ptr<int>(),
         num_active.data_ptr<int>(), num_experts_used.data_ptr<int>(), sorted.data_ptr<int>());
  launch(dim3(unsigned(div_up(inter, kGemvRowsPerCta)), unsigned(num_experts)), dim3(kGemvThreads), 0,
         moe_gate_up_kernel<T, kVec>, x.data_ptr<T>(), x.stride(0), w13.data_ptr<T>(), w13.stride(0), w13.stride(1),
         inter, hidden, top_k, offsets.data_ptr<int>(), active.data_ptr<int>(), num_active.data_ptr<int>(),
         sorted.data_ptr<int>(), h.data_ptr<float>());
  launch(dim3(unsigned(div_up(hidden, kGemvRowsPerCta)), unsigned(num_experts)), dim3(kGemvThreads), 0,
         moe_down_kernel<T, kVec>, h.data_ptr<float>(), w2.data_ptr<T>(), w2.stride(0), w2.stride(1), inter, hidden,
         topk_weights.data_ptr<float>(), offsets.data_ptr<int>(), active.data_ptr<int>(), num_active.data_ptr<int>(),
         sorted.data_ptr<int>(), y.data_ptr<float>());
  launch(dim3(unsigned(num_tokens)), dim3(128), 0, moe_combine_kernel<T, IdT>, y.data_ptr<float>(),
         topk_ids.data_ptr<IdT>(), top_k, hidden, out.data_ptr<T>(), out.stride(0));
}

template <class Launcher>
void moe_grouped_dispatch_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_weights,
                               const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                               at::Tensor& num_experts_used, const Launcher& launch) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "x/out must be [T, H] of equal shape");
  TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0 && w13.size(2) == x.size(1), "w13 must be [E, 2I, H]");
  const int64_t inter = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == w13.size(0) && w2.size(1) == x.size(1) && w2.size(2) == inter,
              "w2 must be [E, H, I]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == w13.scalar_type() &&
                  x.scalar_type() == w2.scalar_type(),
              "x, out and the expert weights must share one dtype");
  TORCH_CHECK(unit_stride(x, 1) && unit_stride(out, 1) && unit_stride(w13, 2) && unit_stride(w2, 2),
              "rows of x, out and the expert weights must be contiguous");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() && topk_weights.dim() == 2 &&
                  topk_weights.size(0) == x.size(0),
              "topk_weights must be contiguous fp32 [T, K]");
  TORCH_CHECK(topk_ids.is_contiguous() && topk_ids.sizes() == topk_weights.sizes() &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "topk_ids must be contiguous int32/int64 [T, K]");
  TORCH_CHECK(num_experts_used.numel() == 1 && num_experts_used.scalar_type() == at::kInt,
              "num_experts_used must be an int32 tensor of one element");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &topk_weights, &topk_ids, &w13, &w2, &num_experts_used})
    check_same_device(out, *t, "moe_grouped_dispatch argument");
  if (x.size(0) == 0 || topk_ids.size(1) == 0) {
    num_experts_used.zero_();
    return;
  }
  const int64_t elem = x.element_size();
  const bool vectorize = can_vectorize(x.data_ptr(), elem, x.size(1), {x.stride(0)}) &&
                         can_vectorize(w13.data_ptr(), elem, x.size(1), {w13.stride(0), w13.stride(1)}) &&
                         can_vectorize(w2.data_ptr(), elem, inter, {w2.stride(0), w2.stride(1)});
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "moe_grouped_dispatch", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    auto run = [&](auto id_tag) {
      using IdT = decltype(id_tag);
      if (vectorize) {
        launch_moe_dispatch<scalar_t, IdT, kVec>(out, x, topk_weights, topk_ids, w13, w2, num_experts_used, launch);
      } else {
        launch_moe_dispatch<scalar_t, IdT, 1>(out, x, topk_weights, topk_ids, w13, w2, num_experts_used, launch);
      }
    };
    if (topk_ids.scalar_type() == at::kInt) {
      run(int32_t{});
    } else {
      run(int64_t{});
    }
  });
}

}  // namespace kernels
}  // namespace sparsever
