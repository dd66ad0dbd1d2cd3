// int4_linear: the W4A8 linear of an int4 draft model for few tokens (semantics: reference.int4_linear).
// Two launches: the tokens quantized per row (int8_linear's kernel), then one warp per weight row, its
// lanes striding over the packed row 4 bytes (8 int4 values) at a time: the low nibbles are channels
// 4j..4j+3 of a 128-channel block and the high ones 64 + 4j.., each unpacked to signed bytes (w + 8 - 8)
// and multiplied with dp4a; each word's integer sum scaled by its group's scale in fp32.
// Correctness-first: the plugin runs this op on CPU only (vLLM's GPU engines keep their own int4 GEMMs).
#pragma once

#include "int8_linear.cuh"

namespace sparsever {
namespace kernels {

constexpr int kInt4Block = 128;  // input channels per 64 packed bytes (reference.unpack_int4_rows)

// Four bytes of nibble values 0..15 (stored w + 8) to the signed bytes w.
SV_DEVICE int nibbles_to_signed4(unsigned v) {
#if defined(__CUDA_ARCH__)
  return int(__vsub4(v, 0x08080808u));
#else
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) out |= ((((v >> (8 * i)) & 0xffu) - 8u) & 0xffu) << (8 * i);
  return int(out);
#endif
}

template <typename T, typename BT>
__global__ void __launch_bounds__(kInt8RowWarps * kWarpSize)
    int4_rows_kernel(const int8_t* __restrict__ q, const float* __restrict__ x_scale, int num_tokens, int k,
                     const uint8_t* __restrict__ w, int64_t w_stride, const float* __restrict__ w_scale, int group,
                     const BT* __restrict__ bias, int n, T* __restrict__ out, int64_t out_stride) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * kInt8RowWarps + warp;
  if (r >= n) return;  // no block-wide barrier below
  const unsigned* row = reinterpret_cast<const unsigned*>(w + int64_t(r) * w_stride);
  const float* scale = w_scale + int64_t(r) * (k / group);
  const int words = k / 8, k4 = k / 4;
  const int* q4 = reinterpret_cast<const int*>(q);
  for (int t0 = 0; t0 < num_tokens; t0 += kInt8Tokens) {
    const int nt = num_tokens - t0 < kInt8Tokens ? num_tokens - t0 : kInt8Tokens;
    float acc[kInt8Tokens];
#pragma unroll
    for (int t = 0; t < kInt8Tokens; ++t) acc[t] = 0.0f;
    for (int c = lane; c < words; c += kWarpSize) {
      const unsigned wv = row[c];
      const int lo = nibbles_to_signed4(wv & 0x0f0f0f0fu), hi = nibbles_to_signed4((wv >> 4) & 0x0f0f0f0fu);
      const int block = c / 16, j = c % 16;  // 16 words a block
      const float s = scale[block * kInt4Block / group];
      const int lo_word = block * (kInt4Block / 4) + j, hi_word = lo_word + 16;  // q as 32-bit words
#pragma unroll
      for (int t = 0; t < kInt8Tokens; ++t)
        if (t < nt) {
          const int* qt = q4 + int64_t(t0 + t) * k4;
          acc[t] += float(dot4_i8(hi, qt[hi_word], dot4_i8(lo, qt[lo_word], 0))) * s;
        }
    }
#pragma unroll
    for (int t = 0; t < kInt8Tokens; ++t) {
      if (t >= nt) break;
      const float sum = warp_reduce_sum(acc[t]);
      if (lane == 0) {
        float y = sum * x_scale[t0 + t];
        if (bias != nullptr) y += to_float(bias[r]);
        out[int64_t(t0 + t) * out_stride + r] = from_float<T>(y);
      }
    }
  }
}

template <class Launcher>
void int4_linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                      const std::optional<at::Tensor>& bias, const Launcher& launch) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight_scale.dim() == 2,
              "int4_linear: x [T, K], weight [N, K / 2] and weight_scale [N, K / group], got ", x.sizes(), ", ",
              weight.sizes(), " and ", weight_scale.sizes());
  const int64_t t = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(k % kInt4Block == 0 && weight.size(1) * 2 == k, "int4_linear: K must be a multiple of ", kInt4Block,
              " and weight [N, K / 2] packed bytes, got x ", x.sizes(), " and weight ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kByte && unit_stride(weight, 1) && weight.stride(0) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 4 == 0,
              "int4_linear: weight must be uint8 (two int4 values a byte) with contiguous, 4-byte aligned rows, got ",
              weight.scalar_type());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.size(0) == n && weight_scale.is_contiguous() &&
                  weight_scale.size(1) > 0 && k % weight_scale.size(1) == 0 &&
                  (k / weight_scale.size(1)) % kInt4Block == 0,
              "int4_linear: weight_scale must be fp32 [N, K / group] with group a multiple of ", kInt4Block, ", got ",
              weight_scale.sizes());
  TORCH_CHECK(unit_stride(x, 1), "int4_linear: x must have contiguous rows");
  check_quantized_linear_out(out, x, n, bias, "int4_linear");
  check_same_device(x, weight, "weight");
  check_same_device(x, weight_scale, "weight_scale");
  if (t == 0 || n == 0) return;
  at::Tensor q, x_scale;
  std::tie(q, x_scale) = quantize_tokens_int8(x, launch);
  const int group = int(k / weight_scale.size(1));
  const dim3 grid(unsigned(div_up<int64_t>(n, kInt8RowWarps))), block(kInt8RowWarps * kWarpSize);
  SV_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int4_linear", [&] {
    using OT = scalar_t;
    auto run = [&](const auto* b) {
      using BT = std::remove_const_t<std::remove_pointer_t<decltype(b)>>;
      launch(grid, block, 0, int4_rows_kernel<OT, BT>, q.data_ptr<int8_t>(), x_scale.data_ptr<float>(), int(t), int(k),
             weight.data_ptr<uint8_t>(), weight.stride(0), weight_scale.data_ptr<float>(), group, b, int(n),
             out.data_ptr<OT>(), out.stride(0));
    };
    if (!bias.has_value()) {
      run(static_cast<const float*>(nullptr));
    } else {
      SV_DISPATCH_FLOAT_TYPES(bias->scalar_type(), "int4_linear_bias", [&] { run(bias->data_ptr<scalar_t>()); });
    }
  });
}

}  // namespace kernels
}  // namespace sparsever
