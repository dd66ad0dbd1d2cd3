// Top-k SwiGLU FFN neuron gating (CPU): reads the gate densely and then only the selected up rows and
// down rows (w_down_t = down_proj.weight.T keeps a neuron's output weights contiguous); the input-sparse
// gate reads only the gate rows of the kept input channels.
#include "cpu_utils.h"
#include "gemv_rows.h"
#include "gemv_rows_bf16.h"
#include "ops.h"
#include "projection_path.h"

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

namespace sparsever::cpu {
namespace {

// Indices of the k largest scores (lower index wins ties), ascending. k <= n. The k-th largest value
// by selection on a copy, then one ascending pass: O(n), no sort of the kept indices (half the time of
// an nth_element over indices plus a sort; docs/kernels.md). NaN scores count as -inf (no comparator
// on NaN: no UB).
void topk_ascending(const float* scores, int64_t n, int64_t k, int32_t* dst, std::vector<float>& tmp) {
  if (k <= 0) return;
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  auto value = [&](int64_t i) { return std::isnan(scores[i]) ? kLowest : scores[i]; };
  tmp.resize(n);
  for (int64_t i = 0; i < n; ++i) tmp[i] = value(i);
  std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<float>());
  const float kth = tmp[k - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += value(i) > kth;
  int64_t ties = k - above, m = 0;  // ties at the k-th value: the lowest indices
  for (int64_t i = 0; i < n && m < k; ++i) {
    const float v = value(i);
    if (v > kth || (v == kth && ties-- > 0)) dst[m++] = static_cast<int32_t>(i);
  }
}

// AMX-BF16 (CPUID leaf 7, EDX bit 22): oneDNN's tile GEMMs, against which the streaming threshold below
// was never measured.
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1u);
  }();
  return has;
#else
  return false;
#endif
}

// The top-k FFN's GEMM path gathers the kept up/down rows (index_select) and runs oneDNN on those
// unpacked copies; a gate the op computes itself runs as one GEMM over the plain gate rows. Streaming
// stays faster below a token count measured per path on a Zen 5 EPYC (docs/kernels.md, 2026-11-26):
// 64 for bf16 on the vdpbf16ps path, 16 for bf16 widened to fp32, 128 for fp32 (torch's fp32 GEMM
// reads the unpacked rows slowly). AMX CPUs keep 16 for bf16 (oneDNN's tile GEMMs; not measured
// against streaming).
inline int64_t ffn_gemm_min_tokens(bool fp32_weights, bool bf16_dot) {
  if (fp32_weights) return gemm_min_tokens(128);
  return gemm_min_tokens(bf16_dot && !cpu_has_amx_bf16() ? 64 : 16);
}

// Columns [r0, r1) of every token's row of a given gate [T, I] (any float dtype, unit column stride)
// into act [T, I] fp32: run inside the gate pass's row tasks, so the copy is parallel and cache-hot.
void gate_rows_to_f32(const torch::Tensor& gate, int64_t r0, int64_t r1, float* act, int64_t inter) {
  SPARSEVER_DISPATCH_FLOAT_TYPES(gate.scalar_type(), "gate_rows_to_f32", [&] {
    const scalar_t* g = gate.data_ptr<scalar_t>();
    for (int64_t t = 0; t < gate.size(0); ++t)
      convert_to_f32<scalar_t>(g + t * gate.stride(0) + r0, act + t * inter + r0, r1 - r0);
  });
}

// `gate`: the gate projection x @ w_gate^T [T, I] when the caller computed it (e.g. on the target's
// packed dense GEMM); else it is computed here from `w_gate` [I, H] (unused when `gate` is given).
template <typename scalar_t>
void ffn_impl(torch::Tensor& out, const torch::Tensor& x, const std::optional<torch::Tensor>& gate,
              const torch::Tensor& w_gate, const torch::Tensor& w_up, const torch::Tensor& w_down_t,
              const torch::Tensor& group_start_loc, int64_t keep, torch::Tensor& selected) {
  const int64_t num_tokens = x.size(0), h = x.size(1);
  const int64_t inter = w_up.size(0);
  const int64_t num_groups = group_start_loc.size(0) - 1;
  auto xf_t = x.to(torch::kFloat).contiguous();
  const float* xf = xf_t.data_ptr<float>();
  // bf16 dot path: the layer input itself, contiguous, with unit-stride weight rows.
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool bf16_dot = kBf16 && use_bf16_dot() && w_gate.stride(1) == 1 && w_up.stride(1) == 1 &&
                        w_down_t.stride(1) == 1;
  const bool spread = spread_prefetch();
  const int64_t gemm_from = gemm_from_for<scalar_t>(ffn_gemm_min_tokens(std::is_same_v<scalar_t, float>, bf16_dot));
  auto xb_t = bf16_dot ? x.contiguous() : torch::Tensor();
  const auto* xb = bf16_dot ? reinterpret_cast<const c10::BFloat16*>(xb_t.data_ptr()) : nullptr;
  const scalar_t* wg = w_gate.data_ptr<scalar_t>();
  const scalar_t* wup = w_up.data_ptr<scalar_t>();
  const scalar_t* wdt = w_down_t.data_ptr<scalar_t>();
  const int64_t wg_stride = w_gate.stride(0), wup_stride = w_up.stride(0), wdt_stride = w_down_t.stride(0);
  const int32_t* gsl = group_start_loc.data_ptr<int32_t>();
  int32_t* sel = selected.data_ptr<int32_t>();

  // Gate projection for every token (dense: the scores need it; given, or computed here), silu and the
  // per-group neuron scores sum_t |silu(gate)|.
  torch::Tensor act_t;
  const bool gate_gemm = !gate.has_value() && num_tokens >= gemm_from;
  if (gate_gemm) {
    act_t = at::linear(x, w_gate).to(torch::kFloat).contiguous();
  } else {  // streamed here, or the given gate converted (silu runs in place: never on the caller's tensor)
    act_t = torch::empty({num_tokens, inter}, torch::kFloat);
  }
  const torch::Tensor given = gate.has_value() ? gate->contiguous() : torch::Tensor();
  float* act = act_t.data_ptr<float>();
  std::vector<float> scores(static_cast<size_t>(num_groups * inter), 0.f);
  {
    const bool streamed = !gate.has_value() && !gate_gemm;
    parallel_row_tasks(inter, h, sizeof(scalar_t), [&](int64_t r0, int64_t r1) {
      if (given.defined())
        gate_rows_to_f32(given, r0, r1, act, inter);
      else if (streamed && bf16_dot)
        rows_dot_range_bf16(xb, num_tokens, h, reinterpret_cast<const c10::BFloat16*>(wg), wg_stride, nullptr, r0,
                            r1, act, inter, spread);
      else if (streamed)
        rows_dot_range<scalar_t>(xf, num_tokens, h, wg, wg_stride, nullptr, r0, r1, act, inter);
      for (int64_t g = 0; g < num_groups; ++g)
        for (int64_t t = gsl[g]; t < gsl[g + 1]; ++t) {
          float* a = act + t * inter;
          float* sc = scores.data() + g * inter;
          silu_inplace(a + r0, r1 - r0);
          for (int64_t n = r0; n < r1; ++n) sc[n] += std::abs(a[n]);
        }
    });
  }

  std::vector<float> out_f(static_cast<size_t>(num_tokens * h), 0.f);
  std::vector<float> up, hid;
  std::vector<float> topk_tmp;
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t t0 = gsl[g], nt = gsl[g + 1] - gsl[g];
    int32_t* idx = sel + g * keep;
    if (nt <= 0) {
      std::fill(idx, idx + keep, -1);
      continue;
    }
    topk_ascending(scores.data() + g * inter, inter, keep, idx, topk_tmp);
    hid.resize(static_cast<size_t>(nt * keep));
    if (nt >= gemm_from) {
      // Gather the selected up rows / down rows once (contiguous rows), then GEMMs.
      auto idx_t = torch::from_blob(idx, {keep}, torch::kInt).to(torch::kLong);
      auto xg = x.narrow(0, t0, nt);
      auto up_t = at::linear(xg, w_up.index_select(0, idx_t)).to(torch::kFloat).contiguous();
      const float* upp = up_t.data_ptr<float>();
      for (int64_t t = 0; t < nt; ++t) {
        const float* a = act + (t0 + t) * inter;
        for (int64_t j = 0; j < keep; ++j) hid[t * keep + j] = a[idx[j]] * upp[t * keep + j];
      }
      auto hid_t = torch::from_blob(hid.data(), {nt, keep}, torch::kFloat).to(x.scalar_type());
      out.narrow(0, t0, nt).copy_(at::mm(hid_t, w_down_t.index_select(0, idx_t)));
      continue;
    }
    // Up projection streaming the selected rows only, then the SwiGLU product.
    up.resize(static_cast<size_t>(nt * keep));
    if (bf16_dot)
      parallel_row_tasks(keep, h, sizeof(scalar_t), [&](int64_t r0, int64_t r1) {
        rows_dot_range_bf16(xb + t0 * h, nt, h, reinterpret_cast<const c10::BFloat16*>(wup), wup_stride, idx, r0,
                            r1, up.data(), keep, spread);
      });
    else
      rows_dot<scalar_t>(xf + t0 * h, nt, h, wup, wup_stride, idx, keep, up.data(), keep);
    for (int64_t t = 0; t < nt; ++t) {
      const float* a = act + (t0 + t) * inter;
      for (int64_t j = 0; j < keep; ++j) hid[t * keep + j] = a[idx[j]] * up[t * keep + j];
    }
    // Down projection streaming the selected rows of w_down_t.
    if (bf16_dot)
      rows_axpy_bf16(hid.data(), nt, keep, reinterpret_cast<const c10::BFloat16*>(wdt), wdt_stride, idx, h,
                     out_f.data() + t0 * h);
    else
      rows_axpy<scalar_t>(hid.data(), nt, keep, wdt, wdt_stride, idx, h, out_f.data() + t0 * h);
    for (int64_t t = t0; t < t0 + nt; ++t) store_from_f32<scalar_t>(out_f.data() + t * h, op + t * h, h);
  }
}

// input_sparse_gate: per group the top-`input_keep` channels of x by sum_t |x[t, c]|, then the gate
// from those channels' rows of w_gate_t [H, I] only, with the down projection's row-axpy kernels (a
// channel's gate weights are one contiguous row of the transposed gate).
template <typename scalar_t>
void input_sparse_gate_impl(torch::Tensor& gate, const torch::Tensor& x, const torch::Tensor& w_gate_t,
                            const torch::Tensor& group_start_loc, int64_t input_keep, torch::Tensor& channels) {
  const int64_t h = x.size(1), inter = w_gate_t.size(1);
  const int64_t num_groups = group_start_loc.size(0) - 1;
  auto xf_t = x.to(torch::kFloat).contiguous();
  const float* xf = xf_t.data_ptr<float>();
  const int32_t* gsl = group_start_loc.data_ptr<int32_t>();
  const scalar_t* w = w_gate_t.data_ptr<scalar_t>();
  const int64_t ws = w_gate_t.stride(0);
  // x is already in the weights' dtype, so rounding it to bf16 pairs (rows_axpy_bf16) is exact.
  const bool bf16_dot = std::is_same_v<scalar_t, c10::BFloat16> && use_bf16_dot() && w_gate_t.stride(1) == 1;
  std::vector<float> scores(static_cast<size_t>(h)), tmp, a, gate_f;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t t0 = gsl[g], nt = gsl[g + 1] - gsl[g];
    int32_t* idx = channels.data_ptr<int32_t>() + g * input_keep;
    if (nt <= 0) {
      std::fill(idx, idx + input_keep, -1);
      continue;
    }
    std::fill(scores.begin(), scores.end(), 0.f);
    for (int64_t t = t0; t < t0 + nt; ++t)
      for (int64_t c = 0; c < h; ++c) scores[c] += std::abs(xf[t * h + c]);
    topk_ascending(scores.data(), h, input_keep, idx, tmp);
    a.resize(static_cast<size_t>(nt * input_keep));
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t j = 0; j < input_keep; ++j) a[t * input_keep + j] = xf[(t0 + t) * h + idx[j]];
    gate_f.resize(static_cast<size_t>(nt * inter));
    if (bf16_dot)
      rows_axpy_bf16(a.data(), nt, input_keep, reinterpret_cast<const c10::BFloat16*>(w), ws, idx, inter,
                     gate_f.data());
    else
      rows_axpy<scalar_t>(a.data(), nt, input_keep, w, ws, idx, inter, gate_f.data());
    scalar_t* gp = gate.data_ptr<scalar_t>();
    for (int64_t t = 0; t < nt; ++t)
      store_from_f32<scalar_t>(gate_f.data() + t * inter, gp + (t0 + t) * gate.stride(0), inter);
  }
}

}  // namespace
}  // namespace sparsever::cpu

namespace {

void check_ffn_args(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w_up,
                    const torch::Tensor& w_down_t, const torch::Tensor& group_start_loc, int64_t keep,
                    const torch::Tensor& selected) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && out.is_contiguous(), "x/out must be [T, H], out contiguous");
  const int64_t inter = w_up.size(0);
  TORCH_CHECK(w_down_t.dim() == 2 && w_down_t.size(0) == inter && w_down_t.size(1) == x.size(1) &&
                  w_down_t.stride(1) == 1,
              "w_down_t must be [I, H] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == w_up.scalar_type() && x.scalar_type() == w_down_t.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "x, out and weights must share a dtype");
  TORCH_CHECK(keep >= 1 && keep <= inter, "keep must be in [1, I]");
  TORCH_CHECK(group_start_loc.scalar_type() == torch::kInt && group_start_loc.is_contiguous(),
              "group_start_loc must be contiguous int32");
  TORCH_CHECK(selected.scalar_type() == torch::kInt && selected.is_contiguous() &&
                  selected.size(0) == group_start_loc.size(0) - 1 && selected.size(1) == keep,
              "selected must be contiguous int32 [G, keep]");
}

}  // namespace

void topk_swiglu_ffn_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w_gate_up,
                         const torch::Tensor& w_down_t, const torch::Tensor& group_start_loc, int64_t keep,
                         torch::Tensor& selected) {
  TORCH_CHECK(w_gate_up.dim() == 2 && w_gate_up.size(1) == x.size(1) && w_gate_up.size(0) % 2 == 0 &&
                  w_gate_up.stride(1) == 1,
              "w_gate_up must be [2I, H] with contiguous rows");
  const int64_t inter = w_gate_up.size(0) / 2;
  const auto w_gate = w_gate_up.narrow(0, 0, inter), w_up = w_gate_up.narrow(0, inter, inter);
  check_ffn_args(out, x, w_up, w_down_t, group_start_loc, keep, selected);
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "topk_swiglu_ffn_cpu", [&] {
    sparsever::cpu::ffn_impl<scalar_t>(out, x, std::nullopt, w_gate, w_up, w_down_t, group_start_loc, keep,
                                       selected);
  });
}

void topk_swiglu_ffn_gated_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate,
                               const torch::Tensor& w_up, const torch::Tensor& w_down_t,
                               const torch::Tensor& group_start_loc, int64_t keep, torch::Tensor& selected) {
  TORCH_CHECK(w_up.dim() == 2 && w_up.size(1) == x.size(1) && w_up.stride(1) == 1,
              "w_up must be [I, H] with contiguous rows");
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == x.size(0) && gate.size(1) == w_up.size(0) &&
                  gate.is_floating_point(),
              "gate must be a floating-point [T, I] (x @ w_gate^T)");
  check_ffn_args(out, x, w_up, w_down_t, group_start_loc, keep, selected);
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "topk_swiglu_ffn_gated_cpu", [&] {
    sparsever::cpu::ffn_impl<scalar_t>(out, x, gate, w_up, w_up, w_down_t, group_start_loc, keep, selected);
  });
}

void input_sparse_gate_cpu(torch::Tensor& gate, const torch::Tensor& x, const torch::Tensor& w_gate_t,
                           const torch::Tensor& group_start_loc, int64_t input_keep, torch::Tensor& channels) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  TORCH_CHECK(w_gate_t.dim() == 2 && w_gate_t.size(0) == x.size(1) && w_gate_t.stride(1) == 1,
              "w_gate_t must be [H, I] (gate_proj.weight.T) with contiguous rows");
  TORCH_CHECK(w_gate_t.scalar_type() == x.scalar_type() && gate.scalar_type() == x.scalar_type(),
              "x, w_gate_t and gate must share a dtype");
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == x.size(0) && gate.size(1) == w_gate_t.size(1) &&
                  (gate.size(1) <= 1 || gate.stride(1) == 1),
              "gate must be [T, I] with contiguous rows");
  TORCH_CHECK(input_keep >= 1 && input_keep <= x.size(1), "input_keep must be in [1, H], got ", input_keep);
  TORCH_CHECK(group_start_loc.scalar_type() == torch::kInt && group_start_loc.dim() == 1 &&
                  group_start_loc.is_contiguous() && group_start_loc.numel() >= 1,
              "group_start_loc must be contiguous int32 [G+1]");
  TORCH_CHECK(channels.scalar_type() == torch::kInt && channels.is_contiguous() && channels.dim() == 2 &&
                  channels.size(0) == group_start_loc.size(0) - 1 && channels.size(1) == input_keep,
              "channels must be contiguous int32 [G, input_keep]");
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "input_sparse_gate_cpu", [&] {
    sparsever::cpu::input_sparse_gate_impl<scalar_t>(gate, x, w_gate_t, group_start_loc, input_keep, channels);
  });
}
