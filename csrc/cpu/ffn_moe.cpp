// Top-k SwiGLU FFN neuron gating and MoE routing/pruning/grouped dispatch (CPU).
// Both read only the weight rows they use: the FFN reads the gate densely and then only the selected
// up rows and down rows (w_down_t = down_proj.weight.T keeps a neuron's output weights contiguous);
// the MoE dispatch reads only the experts that received at least one token.
#include "cpu_utils.h"
#include "gemv_rows.h"
#include "gemv_rows_bf16.h"
#include "ops.h"

#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
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

// Token count from which a projection runs as a GEMM through ATen (oneDNN: AMX / AVX-512 BF16 where the
// CPU has them) instead of the weight-streaming kernels: with many tokens the work is compute-bound and
// the matrix engines win; with few tokens streaming each selected row once wins. MoE experts (their
// weights contiguous: no gather) switch at 16 tokens. SPARSEVER_CPU_GEMM_MIN_TOKENS overrides both; read
// per call, like use_bf16_dot(), so a benchmark can time both paths in one process.
inline int64_t gemm_min_tokens(int64_t fallback = 16) {
  const char* env = std::getenv("SPARSEVER_CPU_GEMM_MIN_TOKENS");
  return env ? std::max<int64_t>(1, std::atoll(env)) : fallback;
}

// The CPU is checked as well as the build: the loader falls back to the AVX2 build on an AVX-512 CPU whose
// `_C_avx512` failed to import, and there torch's 16-bit GEMM is not the slow fallback.
inline bool cpu_has_avx512f() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

// Token count from which 16-bit weights of scalar_t go to an ATen GEMM: `from`, except on CPUs without
// AVX-512 (the AVX2 build), where torch's bf16/fp16 GEMM is a slow fallback (docs/kernels.md, "AVX2"):
// there the weights are streamed at any token count unless SPARSEVER_CPU_GEMM_MIN_TOKENS says.
template <typename scalar_t>
inline int64_t gemm_from_for(int64_t from) {
#if !defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<scalar_t, float>) {
    if (!std::getenv("SPARSEVER_CPU_GEMM_MIN_TOKENS") && !cpu_has_avx512f()) return std::numeric_limits<int64_t>::max();
  }
#endif
  return from;
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

// bf16 weights on a CPU with AVX512-BF16: stream them with vdpbf16ps (gemv_rows_bf16.h) instead of
// widening to fp32. SPARSEVER_CPU_FFN_BF16_DOT=0 turns it off.
inline bool use_bf16_dot() { return rows_bf16_available() && env_switch_on("SPARSEVER_CPU_FFN_BF16_DOT"); }

// rows_dot_range_bf16's prefetch spread over token tiles: faster than prefetching in the first token
// tile only at 8-16 tokens (docs/kernels.md, 2026-11-26). SPARSEVER_CPU_FFN_SPREAD_PREFETCH=0 turns it
// off.
inline bool spread_prefetch() { return env_switch_on("SPARSEVER_CPU_FFN_SPREAD_PREFETCH"); }

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
