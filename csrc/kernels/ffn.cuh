// Top-k SwiGLU FFN neuron gating, CATS-style (semantics: reference.topk_swiglu_ffn).
//
//   1. gate GEMV for every token: act[t, n] = silu(x[t] . w_gate[n])                 (reads all gate rows)
//   2. per token group: score[n] = sum_t |act[t, n]|, block-wide top-`keep` -> one neuron set per group
//   3. up GEMV over the selected rows only: h[t, j] = act[t, n_j] * (x[t] . w_up[n_j])
//   4. down over the selected rows of the transposed copy w_down_t [I, H] (contiguous rows), split over j,
//      then a reduce of the splits.
// Steps 3-4 read 2 * keep rows instead of 2 * I: with the gate, 1/3 + 2r/3 of the dense weight bytes.
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"
#include "topk.cuh"
#include "warp_dot.cuh"

namespace sparsever {
namespace kernels {

constexpr int kFfnSelectThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kGemvThreads)
    ffn_gate_kernel(const T* __restrict__ x, int64_t x_stride, int num_tokens, const T* __restrict__ w_gate,
                    int64_t w_stride, int inter, int hidden, float* __restrict__ act) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int n0 = (blockIdx.x * kGemvWarps + warp) * kGemvRowsPerWarp;
  if (n0 >= inter) return;  // no block barriers below
  const T* rows[kGemvRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) rows[r] = w_gate + int64_t(min_of(n0 + r, inter - 1)) * w_stride;
  for (int t0 = 0; t0 < num_tokens; t0 += kGemvTokens) {
    const int ntok = min_of(kGemvTokens, num_tokens - t0);
    const T* toks[kGemvTokens];
#pragma unroll
    for (int t = 0; t < kGemvTokens; ++t) toks[t] = x + int64_t(t0 + min_of(t, ntok - 1)) * x_stride;
    float acc[kGemvRowsPerWarp][kGemvTokens];
    warp_dot_rows_tokens<kGemvRowsPerWarp, kGemvTokens, kVec>(rows, toks, ntok, hidden, acc);
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
      for (int t = 0; t < kGemvTokens; ++t)
        if (lane == r * kGemvTokens + t && t < ntok && n0 + r < inter)
          act[int64_t(t0 + t) * inter + n0 + r] = silu(acc[r][t]);
  }
}

// topk_swiglu_ffn_gated: the gate projection is given (any float dtype), step 1 is only its silu.
template <typename G>
__global__ void ffn_silu_gate_kernel(const G* __restrict__ gate, int64_t gate_stride, int num_tokens, int inter,
                                     float* __restrict__ act) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(num_tokens) * inter) return;
  const int64_t t = i / inter, n = i % inter;
  act[i] = silu(to_float(gate[t * gate_stride + n]));
}

// One CTA per group: scores sum_t |act[t, n]| into a global scratch row, then the exact top-`keep`
// (ascending). act: the silu'd gate [T, inter] fp32, or x [T, H] itself (input_sparse_gate's channels).
template <typename A>
__global__ void __launch_bounds__(kFfnSelectThreads)
    ffn_select_neurons_kernel(const A* __restrict__ act, int inter, const int* __restrict__ group_start_loc,
                              int keep, float* __restrict__ scores, int* __restrict__ selected,
                              int64_t sel_stride) {
  __shared__ BlockTopkScratch topk_scratch;
  const int g = blockIdx.x;
  const int t0 = group_start_loc[g], t1 = group_start_loc[g + 1];
  int* sel = selected + g * sel_stride;
  if (t1 <= t0) {  // empty group: no neuron set
    for (int j = threadIdx.x; j < keep; j += blockDim.x) sel[j] = -1;
    return;
  }
  float* row = scores + int64_t(g) * inter;
  for (int n = threadIdx.x; n < inter; n += blockDim.x) {
    float s = 0.0f;
    for (int t = t0; t < t1; ++t) s += fabsf(to_float(act[int64_t(t) * inter + n]));
    row[n] = s;
  }
  __syncthreads();
  block_topk_ascending([&](int n) { return row[n]; }, inter, keep, sel, topk_scratch);
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kGemvThreads)
    ffn_up_selected_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ w_up, int64_t w_stride,
                           int hidden, const float* __restrict__ act, int inter,
                           const int* __restrict__ group_start_loc, const int* __restrict__ selected,
                           int64_t sel_stride, int keep, float* __restrict__ h) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = blockIdx.y;
  const int t_begin = group_start_loc[g], t_end = group_start_loc[g + 1];
  const int j0 = (blockIdx.x * kGemvWarps + warp) * kGemvRowsPerWarp;
  if (j0 >= keep || t_end <= t_begin) return;
  const int* sel = selected + g * sel_stride;
  int neuron[kGemvRowsPerWarp];
  const T* rows[kGemvRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) {
    neuron[r] = sel[min_of(j0 + r, keep - 1)];
    rows[r] = w_up + int64_t(neuron[r]) * w_stride;
  }
  for (int t0 = t_begin; t0 < t_end; t0 += kGemvTokens) {
    const int ntok = min_of(kGemvTokens, t_end - t0);
    const T* toks[kGemvTokens];
#pragma unroll
    for (int t = 0; t < kGemvTokens; ++t) toks[t] = x + int64_t(t0 + min_of(t, ntok - 1)) * x_stride;
    float acc[kGemvRowsPerWarp][kGemvTokens];
    warp_dot_rows_tokens<kGemvRowsPerWarp, kGemvTokens, kVec>(rows, toks, ntok, hidden, acc);
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
      for (int t = 0; t < kGemvTokens; ++t)
        if (lane == r * kGemvTokens + t && t < ntok && j0 + r < keep)
          h[int64_t(t0 + t) * keep + j0 + r] = act[int64_t(t0 + t) * inter + neuron[r]] * acc[r][t];
  }
}

// out[t, c] (or a split's partial) = sum_j h[t, j] * w_down_t[n_j, c]; each thread owns kVec columns.
template <typename T, int kVec>
__global__ void __launch_bounds__(kGemvThreads)
    ffn_down_selected_kernel(const float* __restrict__ h, const T* __restrict__ w_down_t, int64_t w_stride,
                             int hidden, const int* __restrict__ group_start_loc, const int* __restrict__ selected,
                             int64_t sel_stride, int keep, int num_splits, T* __restrict__ out,
                             int64_t out_stride, float* __restrict__ partial, int num_tokens) {
  const int g = blockIdx.z, split = blockIdx.y;
  const int c0 = (blockIdx.x * kGemvThreads + threadIdx.x) * kVec;
  const int t_begin = group_start_loc[g], t_end = group_start_loc[g + 1];
  if (c0 >= hidden || t_end <= t_begin) return;
  const int per_split = div_up(keep, num_splits);
  const int j_begin = split * per_split, j_end = min_of(keep, j_begin + per_split);
  const int* sel = selected + g * sel_stride;
  for (int t0 = t_begin; t0 < t_end; t0 += kGemvTokens) {
    const int ntok = min_of(kGemvTokens, t_end - t0);
    float acc[kGemvTokens][kVec];
#pragma unroll
    for (int t = 0; t < kGemvTokens; ++t)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[t][e] = 0.0f;
    for (int j = j_begin; j < j_end; ++j) {
      float w[kVec];
      load_as_float<T, kVec>(w_down_t + int64_t(sel[j]) * w_stride + c0, w);
#pragma unroll
      for (int t = 0; t < kGemvTokens; ++t) {
        if (t < ntok) {
          const float hv = h[int64_t(t0 + t) * keep + j];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[t][e] = fmaf(hv, w[e], acc[t][e]);
        }
      }
    }
    for (int t = 0; t < ntok; ++t) {
      if (num_splits == 1) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[int64_t(t0 + t) * out_stride + c0 + e] = from_float<T>(acc[t][e]);
      } else {
        float* dst = partial + (int64_t(split) * num_tokens + t0 + t) * hidden + c0;
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] = acc[t][e];
      }
    }
  }
}

template <typename T>
__global__ void ffn_reduce_splits_kernel(const float* __restrict__ partial, int num_splits, int num_tokens,
                                         int hidden, const int* __restrict__ group_start_loc, T* __restrict__ out,
                                         int64_t out_stride) {
  const int g = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= hidden) return;
  for (int t = group_start_loc[g]; t < group_start_loc[g + 1]; ++t) {
    float v = 0.0f;
    for (int s = 0; s < num_splits; ++s) v += partial[(int64_t(s) * num_tokens + t) * hidden + c];
    out[int64_t(t) * out_stride + c] = from_float<T>(v);
  }
}

// input_sparse_gate: h[t, j] = x[t, channel_j] for the group's kept channels (the "activations" of the
// down kernel, which then sums the kept rows of w_gate_t).
template <typename T>
__global__ void gather_channels_kernel(const T* __restrict__ x, int64_t x_stride, const int* __restrict__ group_start_loc,
                                       const int* __restrict__ channels, int64_t ch_stride, int keep,
                                       float* __restrict__ h) {
  const int g = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= keep) return;
  const int c = channels[g * ch_stride + j];
  for (int t = group_start_loc[g]; t < group_start_loc[g + 1]; ++t)
    h[int64_t(t) * keep + j] = to_float(x[int64_t(t) * x_stride + c]);
}

inline int ffn_down_num_splits(int64_t ctas, int64_t keep, int num_sms, int forced) {
  if (forced > 0) return int(std::min<int64_t>(forced, std::max<int64_t>(keep, 1)));
  const int64_t want = div_up<int64_t>(2 * int64_t(num_sms), std::max<int64_t>(ctas, 1));
  return int(std::max<int64_t>(1, std::min<int64_t>({want, std::max<int64_t>(1, keep / 16), 64})));
}

// out[t] = sum_j h[t, j] * w_t[selected[g, j]] for each group's tokens (w_t [rows, N], out [T, N]): the
// down kernel split over j where the columns alone give too few CTAs, then the splits' reduce.
template <typename T, int kVec, class Launcher>
void launch_down_selected(const at::Tensor& h, const at::Tensor& w_t, const int* gsl, const at::Tensor& selected,
                          int keep, int num_groups, int num_tokens, at::Tensor& out, const Launcher& launch) {
  const int n = int(w_t.size(1));
  const int col_ctas = div_up(n, kGemvThreads * kVec);
  const int splits = ffn_down_num_splits(int64_t(col_ctas) * num_groups, keep, launch.num_sms, launch.forced_splits);
  at::Tensor partial;
  if (splits > 1) partial = at::empty({splits, num_tokens, n}, h.options());
  launch(dim3(unsigned(col_ctas), unsigned(splits), unsigned(num_groups)), dim3(kGemvThreads), 0,
         ffn_down_selected_kernel<T, kVec>, h.data_ptr<float>(), w_t.data_ptr<T>(), w_t.stride(0), n, gsl,
         selected.data_ptr<int>(), selected.stride(0), keep, splits, out.data_ptr<T>(), out.stride(0),
         splits > 1 ? partial.data_ptr<float>() : nullptr, num_tokens);
  if (splits > 1) {
    launch(dim3(unsigned(div_up(n, 256)), unsigned(num_groups)), dim3(256), 0, ffn_reduce_splits_kernel<T>,
           partial.data_ptr<float>(), splits, num_tokens, n, gsl, out.data_ptr<T>(), out.stride(0));
  }
}

// `gate` given: act = silu(gate) (topk_swiglu_ffn_gated, `w_gate` unused); else the gate GEMV over `w_gate`.
template <typename T, int kVec, class Launcher>
void launch_ffn(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& gate, const at::Tensor& w_gate,
                const at::Tensor& w_up, const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                at::Tensor& selected, const Launcher& launch) {
  const int num_tokens = int(x.size(0)), hidden = int(x.size(1)), inter = int(w_up.size(0));
  const int num_groups = int(group_start_loc.numel() - 1);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor act = at::empty({num_tokens, inter}, f32);
  at::Tensor scores = at::empty({std::max(num_groups, 1), inter}, f32);
  at::Tensor h = at::empty({num_tokens, keep}, f32);
  const T* xp = x.data_ptr<T>();
  const int* gsl = group_start_loc.data_ptr<int>();
  if (gate.has_value()) {
    SV_DISPATCH_FLOAT_TYPES(gate->scalar_type(), "ffn_silu_gate", [&] {
      launch(dim3(unsigned(div_up<int64_t>(int64_t(num_tokens) * inter, 256))), dim3(256), 0,
             ffn_silu_gate_kernel<scalar_t>, gate->data_ptr<scalar_t>(), gate->stride(0), num_tokens, inter,
             act.data_ptr<float>());
    });
  } else {
    launch(dim3(unsigned(div_up(inter, kGemvRowsPerCta))), dim3(kGemvThreads), 0, ffn_gate_kernel<T, kVec>, xp,
           x.stride(0), num_tokens, w_gate.data_ptr<T>(), w_gate.stride(0), inter, hidden, act.data_ptr<float>());
  }
  launch(dim3(unsigned(num_groups)), dim3(kFfnSelectThreads), 0, ffn_select_neurons_kernel<float>, act.data_ptr<float>(),
         inter, gsl, int(keep), scores.data_ptr<float>(), selected.data_ptr<int>(), selected.stride(0));
  launch(dim3(unsigned(div_up<int64_t>(keep, kGemvRowsPerCta)), unsigned(num_groups)), dim3(kGemvThreads), 0,
         ffn_up_selected_kernel<T, kVec>, xp, x.stride(0), w_up.data_ptr<T>(), w_up.stride(0), hidden,
         act.data_ptr<float>(), inter, gsl, selected.data_ptr<int>(), selected.stride(0), int(keep),
         h.data_ptr<float>());
  launch_down_selected<T, kVec>(h, w_down_t, gsl, selected, int(keep), num_groups, num_tokens, out, launch);
}

// group_start_loc int32 [G+1] contiguous, `sel` int32 [G, k] with contiguous rows; returns G.
inline int64_t check_groups_and_selection(const at::Tensor& group_start_loc, const at::Tensor& sel, int64_t k,
                                          const char* sel_name, const char* k_name) {
  check_int32(group_start_loc, "group_start_loc");
  check_int32(sel, sel_name);
  TORCH_CHECK(group_start_loc.dim() == 1 && group_start_loc.is_contiguous() && group_start_loc.numel() >= 1,
              "group_start_loc must be contiguous [G+1]");
  const int64_t num_groups = group_start_loc.numel() - 1;
  TORCH_CHECK(sel.dim() == 2 && sel.size(0) == num_groups && sel.size(1) == k && unit_stride(sel, 1), sel_name,
              " must be [G, ", k_name, "] with contiguous rows");
  return num_groups;
}

template <class Launcher>
void ffn_checked(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& gate, const at::Tensor& w_gate,
                 const at::Tensor& w_up, const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                 at::Tensor& selected, const Launcher& launch) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "x/out must be [T, H] of equal shape");
  const int64_t inter = w_up.size(0);
  TORCH_CHECK(w_down_t.dim() == 2 && w_down_t.size(0) == inter && w_down_t.size(1) == x.size(1),
              "w_down_t must be [I, H]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == w_gate.scalar_type() &&
                  x.scalar_type() == w_up.scalar_type() && x.scalar_type() == w_down_t.scalar_type(),
              "x, out and the weights must share one dtype");
  TORCH_CHECK(unit_stride(x, 1) && unit_stride(out, 1) && unit_stride(w_gate, 1) && unit_stride(w_up, 1) &&
                  unit_stride(w_down_t, 1),
              "rows of x, out and the weights must be contiguous");
  TORCH_CHECK(keep >= 1 && keep <= inter, "keep must be in [1, I], got ", keep);
  const int64_t num_groups = check_groups_and_selection(group_start_loc, selected, keep, "selected", "keep");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&x, &w_gate, &w_up, &w_down_t, &group_start_loc, &selected})
    check_same_device(out, *t, "topk_swiglu_ffn argument");
  if (gate.has_value()) {
    TORCH_CHECK(gate->dim() == 2 && gate->size(0) == x.size(0) && gate->size(1) == inter &&
                    gate->is_floating_point() && unit_stride(*gate, 1),
                "gate must be a floating-point [T, I] (x @ w_gate^T) with contiguous rows");
    check_same_device(out, *gate, "topk_swiglu_ffn_gated gate");
  }
  if (num_groups == 0) return;
  const int64_t elem = x.element_size();
  const int64_t hidden = x.size(1);
  const bool vectorize = can_vectorize(x.data_ptr(), elem, hidden, {x.stride(0)}) &&
                         can_vectorize(out.data_ptr(), elem, hidden, {out.stride(0)}) &&
                         can_vectorize(w_gate.data_ptr(), elem, hidden, {w_gate.stride(0)}) &&
                         can_vectorize(w_up.data_ptr(), elem, hidden, {w_up.stride(0)}) &&
                         can_vectorize(w_down_t.data_ptr(), elem, hidden, {w_down_t.stride(0)});
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "topk_swiglu_ffn", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (vectorize) {
      launch_ffn<scalar_t, kVec>(out, x, gate, w_gate, w_up, w_down_t, group_start_loc, keep, selected, launch);
    } else {
      launch_ffn<scalar_t, 1>(out, x, gate, w_gate, w_up, w_down_t, group_start_loc, keep, selected, launch);
    }
  });
}

template <class Launcher>
void topk_swiglu_ffn_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w_gate_up,
                          const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                          at::Tensor& selected, const Launcher& launch) {
  TORCH_CHECK(w_gate_up.dim() == 2 && w_gate_up.size(0) % 2 == 0 && w_gate_up.size(1) == x.size(1),
              "w_gate_up must be [2I, H]");
  const int64_t inter = w_gate_up.size(0) / 2;
  ffn_checked(out, x, std::nullopt, w_gate_up.narrow(0, 0, inter), w_gate_up.narrow(0, inter, inter), w_down_t,
              group_start_loc, keep, selected, launch);
}

template <class Launcher>
void topk_swiglu_ffn_gated_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w_up,
                                const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                                at::Tensor& selected, const Launcher& launch) {
  TORCH_CHECK(w_up.dim() == 2 && w_up.size(1) == x.size(1), "w_up must be [I, H]");
  ffn_checked(out, x, std::optional<at::Tensor>(gate), w_up, w_up, w_down_t, group_start_loc, keep, selected,
              launch);
}

// input_sparse_gate (semantics: reference.input_sparse_gate): channel scores and top-`input_keep` per
// group (the neuron selection kernel, on x), the kept x values, then the down kernel over the kept rows
// of w_gate_t [H, I]: input_keep / H of the gate's bytes.
template <typename T, int kVec, class Launcher>
void launch_input_sparse_gate(at::Tensor& gate, const at::Tensor& x, const at::Tensor& w_gate_t,
                              const at::Tensor& group_start_loc, int64_t input_keep, at::Tensor& channels,
                              const Launcher& launch) {
  const int num_tokens = int(x.size(0)), hidden = int(x.size(1));
  const int num_groups = int(group_start_loc.numel() - 1), keep = int(input_keep);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({num_groups, hidden}, f32);
  at::Tensor h = at::empty({num_tokens, keep}, f32);
  at::Tensor xc = x.stride(1) == 1 && x.stride(0) == hidden ? x : x.contiguous();  // the scores read rows of H
  const int* gsl = group_start_loc.data_ptr<int>();
  launch(dim3(unsigned(num_groups)), dim3(kFfnSelectThreads), 0, ffn_select_neurons_kernel<T>, xc.data_ptr<T>(),
         hidden, gsl, keep, scores.data_ptr<float>(), channels.data_ptr<int>(), channels.stride(0));
  launch(dim3(unsigned(div_up(keep, 256)), unsigned(num_groups)), dim3(256), 0, gather_channels_kernel<T>,
         xc.data_ptr<T>(), xc.stride(0), gsl, channels.data_ptr<int>(), channels.stride(0), keep, h.data_ptr<float>());
  launch_down_selected<T, kVec>(h, w_gate_t, gsl, channels, keep, num_groups, num_tokens, gate, launch);
}

template <class Launcher>
void input_sparse_gate_impl(at::Tensor& gate, const at::Tensor& x, const at::Tensor& w_gate_t,
                            const at::Tensor& group_start_loc, int64_t input_keep, at::Tensor& channels,
                            const Launcher& launch) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  TORCH_CHECK(w_gate_t.dim() == 2 && w_gate_t.size(0) == x.size(1) && unit_stride(w_gate_t, 1),
              "w_gate_t must be [H, I] (gate_proj.weight.T) with contiguous rows");
  TORCH_CHECK(w_gate_t.scalar_type() == x.scalar_type() && gate.scalar_type() == x.scalar_type(),
              "x, w_gate_t and gate must share a dtype");
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == x.size(0) && gate.size(1) == w_gate_t.size(1) && unit_stride(gate, 1),
              "gate must be [T, I] with contiguous rows");
  TORCH_CHECK(input_keep >= 1 && input_keep <= x.size(1), "input_keep must be in [1, H], got ", input_keep);
  const int64_t num_groups =
      check_groups_and_selection(group_start_loc, channels, input_keep, "channels", "input_keep");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &w_gate_t, &group_start_loc, &channels})
    check_same_device(gate, *t, "input_sparse_gate argument");
  if (num_groups == 0) return;
  const int64_t elem = x.element_size(), inter = w_gate_t.size(1);
  const bool vectorize = can_vectorize(w_gate_t.data_ptr(), elem, inter, {w_gate_t.stride(0)}) &&
                         can_vectorize(gate.data_ptr(), elem, inter, {gate.stride(0)});
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "input_sparse_gate", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (vectorize) {
      launch_input_sparse_gate<scalar_t, kVec>(gate, x, w_gate_t, group_start_loc, input_keep, channels, launch);
    } else {
      launch_input_sparse_gate<scalar_t, 1>(gate, x, w_gate_t, group_start_loc, input_keep, channels, launch);
    }
  });
}

}  // namespace kernels
}  // namespace sparsever
