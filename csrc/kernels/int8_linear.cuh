// int8_linear: the W8A8 linear of an int8 draft model for few tokens (semantics: reference.int8_linear).
// Two launches: the tokens quantized per row (one warp per token: amax, then round half to even), then one
// warp per weight row, its lanes striding over the row 4 bytes at a time with dp4a (signed bytes both
// sides, so no offset as on the CPU's VNNI path) for up to kInt8Tokens tokens per pass over the row.
// Correctness-first: the plugin runs this op on CPU only (vLLM's GPU engines keep their own int8 GEMMs).
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"

#include <tuple>
#include <utility>

namespace sparsever {
namespace kernels {

constexpr int kInt8RowWarps = 4;
constexpr int kInt8Tokens = 8;  // tokens per pass over a row: register accumulators per lane

SV_DEVICE int warp_reduce_sum_int(int v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

SV_DEVICE int dot4_i8(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i)
    c += int(static_cast<int8_t>((a >> (8 * i)) & 0xff)) * int(static_cast<int8_t>((b >> (8 * i)) & 0xff));
  return c;
#endif
}

template <typename T>
__global__ void __launch_bounds__(kWarpSize)
    int8_quantize_kernel(const T* __restrict__ x, int64_t x_stride, int k, int8_t* __restrict__ q,
                         float* __restrict__ scale) {
  const int t = blockIdx.x, lane = threadIdx.x;
  const T* row = x + int64_t(t) * x_stride;
  float amax = 0.0f;
  for (int c = lane; c < k; c += kWarpSize) amax = fmaxf(amax, fabsf(to_float(row[c])));
  amax = warp_reduce_max(amax);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  if (lane == 0) scale[t] = amax / 127.0f;
  for (int c = lane; c < k; c += kWarpSize)
    q[int64_t(t) * k + c] = static_cast<int8_t>(fminf(127.0f, fmaxf(-127.0f, rintf(to_float(row[c]) * inv))));
}

template <typename T, typename BT, bool kVec4>
__global__ void __launch_bounds__(kInt8RowWarps * kWarpSize)
    int8_rows_kernel(const int8_t* __restrict__ q, const float* __restrict__ x_scale, int num_tokens, int k,
                     const int8_t* __restrict__ w, int64_t w_stride, const float* __restrict__ w_scale,
                     const BT* __restrict__ bias, int n, T* __restrict__ out, int64_t out_stride) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * kInt8RowWarps + warp;
  if (r >= n) return;  // no block-wide barrier below
  const int8_t* row = w + int64_t(r) * w_stride;
  for (int t0 = 0; t0 < num_tokens; t0 += kInt8Tokens) {
    const int nt = num_tokens - t0 < kInt8Tokens ? num_tokens - t0 : kInt8Tokens;
    int acc[kInt8Tokens];
#pragma unroll
    for (int t = 0; t < kInt8Tokens; ++t) acc[t] = 0;
    if constexpr (kVec4) {
      // One base pointer and a 32-bit token stride, not a 64-bit pointer per token (those spill on sm_80).
      const int* w4 = reinterpret_cast<const int*>(row);
      const int* q4 = reinterpret_cast<const int*>(q + int64_t(t0) * k);
      const int k4 = k / 4;
      for (int c = lane; c < k4; c += kWarpSize) {
        const int wv = w4[c];
#pragma unroll
        for (int t = 0; t < kInt8Tokens; ++t)
          if (t < nt) acc[t] = dot4_i8(wv, q4[t * k4 + c], acc[t]);
      }
    } else {
      const int8_t* qt = q + int64_t(t0) * k;
      for (int c = lane; c < k; c += kWarpSize) {
        const int wv = row[c];
#pragma unroll
        for (int t = 0; t < kInt8Tokens; ++t)
          if (t < nt) acc[t] += wv * int(qt[t * k + c]);
      }
    }
#pragma unroll
    for (int t = 0; t < kInt8Tokens; ++t) {
      if (t >= nt) break;
      const int s = warp_reduce_sum_int(acc[t]);
      if (lane == 0) {
        float y = float(s) * (x_scale[t0 + t] * w_scale[r]);
        if (bias != nullptr) y += to_float(bias[r]);
        out[int64_t(t0 + t) * out_stride + r] = from_float<T>(y);
      }
    }
  }
}

// What the W8A8 and W4A8 linears check of out and bias, and of where their tensors are.
inline void check_quantized_linear_out(const at::Tensor& out, const at::Tensor& x, int64_t n,
                                       const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && unit_stride(out, 1) &&
                  out.scalar_type() == x.scalar_type(),
              op, ": out must be [T, N] in x's dtype with contiguous rows");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()), op,
              ": bias must be [N]");
  check_same_device(x, out, "out");
  if (bias.has_value()) check_same_device(x, *bias, "bias");
}

// x [T, K] quantized per token: (q [T, K] int8, scale [T] fp32), one warp per token.
template <class Launcher>
std::pair<at::Tensor, at::Tensor> quantize_tokens_int8(const at::Tensor& x, const Launcher& launch) {
  const int64_t t = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({t, k}, x.options().dtype(at::kChar));
  at::Tensor x_scale = at::empty({t}, x.options().dtype(at::kFloat));
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int8_quantize", [&] {
    launch(dim3(unsigned(t)), dim3(kWarpSize), 0, int8_quantize_kernel<scalar_t>, x.data_ptr<scalar_t>(), x.stride(0),
           int(k), q.data_ptr<int8_t>(), x_scale.data_ptr<float>());
  });
  return {q, x_scale};
}

template <class Launcher>
void int8_linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                      const at::Tensor& weight_sum, const std::optional<at::Tensor>& bias, const Launcher& launch) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "int8_linear: x [T, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar && unit_stride(weight, 1),
              "int8_linear: weight must be int8 with contiguous rows, got ", weight.scalar_type());
  TORCH_CHECK(unit_stride(x, 1), "int8_linear: x must have contiguous rows");
  const int64_t t = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == n && weight_scale.is_contiguous(),
              "int8_linear: weight_scale must be fp32 [N] (one scale per row)");
  TORCH_CHECK(weight_sum.scalar_type() == at::kInt && weight_sum.numel() == n && weight_sum.is_contiguous(),
              "int8_linear: weight_sum must be int32 [N] (weight.sum(1))");
  check_quantized_linear_out(out, x, n, bias, "int8_linear");
  check_same_device(x, weight, "weight");
  check_same_device(x, weight_scale, "weight_scale");
  if (t == 0 || n == 0) return;
  at::Tensor q, x_scale;
  std::tie(q, x_scale) = quantize_tokens_int8(x, launch);
  const bool vec4 = k % 4 == 0 && weight.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 4 == 0;
  const dim3 grid(unsigned(div_up<int64_t>(n, kInt8RowWarps))), block(kInt8RowWarps * kWarpSize);
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int8_linear", [&] {
    using OT = scalar_t;
    auto run = [&](const auto* b) {
      using BT = std::remove_const_t<std::remove_pointer_t<decltype(b)>>;
      const auto kernel = vec4 ? int8_rows_kernel<OT, BT, true> : int8_rows_kernel<OT, BT, false>;
      launch(grid, block, 0, kernel, q.data_ptr<int8_t>(), x_scale.data_ptr<float>(), int(t), int(k),
             weight.data_ptr<int8_t>(), weight.stride(0), weight_scale.data_ptr<float>(), b, int(n),
             out.data_ptr<OT>(), out.stride(0));
    };
    if (!bias.has_value()) {
      run(static_cast<const float*>(nullptr));
    } else {
      SV_DISPATCH_FLOAT_TYPES(bias->scalar_type(), "int8_linear_bias", [&] { run(bias->data_ptr<scalar_t>()); });
    }
  });
}

}  // namespace kernels
}  // namespace sparsever
