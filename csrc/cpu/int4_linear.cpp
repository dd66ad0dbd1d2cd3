// int4_linear on CPU: the linear of an int4 draft model (W4, symmetric, one scale per group of input
// channels) with its activations quantized per token to int8 at run time (W4A8), for the few tokens a
// draft pass carries. vLLM-CPU runs such a layer as W4A16 on CPUs without AMX, unpacking each weight to
// bf16 (slower than reading bf16 weights); read as nibbles, a row is a quarter of its bf16 bytes and half
// of its int8 ones.
//
// Layout (_custom_ops.pack_int4_rows writes it, reference.unpack_int4_rows reads it): each row's 128-channel
// block is 64 bytes, byte j holding channel j (low nibble) and channel 64 + j (high nibble), each stored as
// w + 8 (0..15). One 64-byte load is then a block, its two nibble halves the unsigned operands of two
// vpdpbusd against 64 signed activation bytes each: sum((w + 8) * q) - 8 * sum(q) = sum(w * q), the
// second term per integer lane, computed once per call (lane_offsets). Without VNNI (the AVX2 build, or
// a CPU without it) a portable loop gives the same integers.
#include "cpu_utils.h"
#include "gemv_rows.h"  // for_each_token_tile
#include "quantize_tokens.h"

#include "ops.h"  // int8_vnni_available

#include <vector>

namespace sparsever::cpu {
namespace {

constexpr int64_t kInt4Block = 128;  // input channels per 64-byte block

// The +8 offset of the stored nibbles, taken back in the integer lanes: vpdpbusd's lane l sums bytes
// 4l..4l+3 of each 64-byte operand, so lane l of a block's sums starts at -8 times the sum of those
// bytes of the block's two activation halves. offset [T, blocks, 16] int32, computed once per call.
inline void lane_offsets(const int8_t* q, int64_t num_tokens, int64_t k, int32_t* offset) {
  const int64_t blocks = k / kInt4Block;
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int l = 0; l < 16; ++l) {
        const int8_t* lo = q + t * k + b * kInt4Block + 4 * l;
        int32_t sum = 0;
        for (int i = 0; i < 4; ++i) sum += int32_t(lo[i]) + int32_t(lo[64 + i]);
        offset[(t * blocks + b) * 16 + l] = -8 * sum;
      }
}

#if defined(CPU_CAPABILITY_AVX512)
#define SPARSEVER_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// As int8_linear's rows: one stream per thread, each block prefetching this far ahead (without it a
// pass from DRAM ran about 15% slower on a Zen 5).
constexpr int64_t kInt4PrefetchBytes = 4096;

// sums[t] += the integer sums q[t, c] * (w[c] + 8) of one block (64 packed bytes, 128 channels), per lane.
template <int NT>
SPARSEVER_AVX512_VNNI __attribute__((always_inline)) inline void block_sums(const int8_t* q, int64_t k,
                                                                            const uint8_t* line, __m512i* sums) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  _mm_prefetch(reinterpret_cast<const char*>(line + kInt4PrefetchBytes), _MM_HINT_T0);  // (a hint: cannot fault)
  const __m512i wv = _mm512_loadu_si512(line);
  const __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t) {
    sums[t] = _mm512_dpbusd_epi32(sums[t], lo, _mm512_loadu_si512(q + t * k));
    sums[t] = _mm512_dpbusd_epi32(sums[t], hi, _mm512_loadu_si512(q + t * k + 64));
  }
}

// acc_out[t] = sum_g scale[g] * sum_{c in group g} q[t, c] * w[c] for NT <= 4 tokens: each group's
// integer sums exact (started at the lane offsets, `lane_offsets`), converted and scaled in fp32 lanes.
// Groups of one block (128 channels, what int4 checkpoints use) two at a time into two fp32
// accumulators per token, so that consecutive groups' multiply-adds do not wait on each other.
template <int NT>
SPARSEVER_AVX512_VNNI inline void dot_row_int4_vnni(const int8_t* q, const int32_t* offset, int64_t k,
                                                    const uint8_t* row, const float* scale, int64_t blocks_per_group,
                                                    float* acc_out) {
  const int64_t blocks = k / kInt4Block;
  __m512 acc0[4], acc1[4];
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  auto start = [&](int64_t b, __m512i* sums) {
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) sums[t] = _mm512_loadu_si512(offset + (t * blocks + b) * 16);
  };
  if (blocks_per_group == 1) {
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      __m512i s0[4], s1[4];
      start(b, s0);
      start(b + 1, s1);
      block_sums<NT>(q + b * kInt4Block, k, row + b * (kInt4Block / 2), s0);
      block_sums<NT>(q + (b + 1) * kInt4Block, k, row + (b + 1) * (kInt4Block / 2), s1);
      const __m512 sc0 = _mm512_set1_ps(scale[b]), sc1 = _mm512_set1_ps(scale[b + 1]);
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) {
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[t]), sc0, acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[t]), sc1, acc1[t]);
      }
    }
    if (b < blocks) {
      __m512i s0[4];
      start(b, s0);
      block_sums<NT>(q + b * kInt4Block, k, row + b * (kInt4Block / 2), s0);
      const __m512 sc0 = _mm512_set1_ps(scale[b]);
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[t]), sc0, acc0[t]);
    }
  } else {
    for (int64_t b0 = 0, g = 0; b0 < blocks; b0 += blocks_per_group, ++g) {
      __m512i sums[4];
      start(b0, sums);
      for (int64_t b = b0; b < b0 + blocks_per_group; ++b) {
        if (b > b0) {
          SPARSEVER_UNROLL
          for (int t = 0; t < NT; ++t)
            sums[t] = _mm512_add_epi32(sums[t], _mm512_loadu_si512(offset + (t * blocks + b) * 16));
        }
        block_sums<NT>(q + b * kInt4Block, k, row + b * (kInt4Block / 2), sums);
      }
      const __m512 sc = _mm512_set1_ps(scale[g]);
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), sc, acc0[t]);
    }
  }
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t) acc_out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

// dot_row_int4_vnni for two rows at once, groups of one block: each token's activation and offset loads
// shared by both rows, and the two rows' multiply-add chains independent. acc_out[t] is row 0's,
// acc_out[NT + t] row 1's.
template <int NT>
SPARSEVER_AVX512_VNNI inline void dot_two_rows_int4_vnni(const int8_t* q, const int32_t* offset, int64_t k,
                                                         const uint8_t* row0, const uint8_t* row1,
                                                         const float* scale0, const float* scale1, float* acc_out) {
  const int64_t blocks = k / kInt4Block;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc0[4], acc1[4];
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* line0 = row0 + b * (kInt4Block / 2);
    const uint8_t* line1 = row1 + b * (kInt4Block / 2);
    _mm_prefetch(reinterpret_cast<const char*>(line0 + kInt4PrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line1 + kInt4PrefetchBytes), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(line0), w1 = _mm512_loadu_si512(line1);
    const __m512i lo0 = _mm512_and_si512(w0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low);
    const __m512i lo1 = _mm512_and_si512(w1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low);
    const __m512 sc0 = _mm512_set1_ps(scale0[b]), sc1 = _mm512_set1_ps(scale1[b]);
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* qb = q + t * k + b * kInt4Block;
      const __m512i off = _mm512_loadu_si512(offset + (t * blocks + b) * 16);
      const __m512i qlo = _mm512_loadu_si512(qb), qhi = _mm512_loadu_si512(qb + 64);
      const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(off, lo0, qlo), hi0, qhi);
      const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(off, lo1, qlo), hi1, qhi);
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), sc0, acc0[t]);
      acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), sc1, acc1[t]);
    }
  }
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t) {
    acc_out[t] = _mm512_reduce_add_ps(acc0[t]);
    acc_out[NT + t] = _mm512_reduce_add_ps(acc1[t]);
  }
}
#endif

// The same sums without VNNI: sum_g scale[g] * sum_{c in g} q[t, c] * w[c].
inline void dot_row_int4_portable(const int8_t* q, int64_t num_tokens, int64_t k, const uint8_t* row,
                                  const float* scale, int64_t group, float* acc_out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int8_t* qt = q + t * k;
    float acc = 0.f;
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      int32_t s = 0;
      for (int64_t c = g0; c < g0 + group; ++c) {
        const uint8_t byte = row[(c / kInt4Block) * (kInt4Block / 2) + c % (kInt4Block / 2)];
        const int32_t w = ((c % kInt4Block) < kInt4Block / 2 ? (byte & 0x0f) : (byte >> 4)) - 8;
        s += w * int32_t(qt[c]);
      }
      acc += float(s) * scale[g0 / group];
    }
    acc_out[t] = acc;
  }
}

template <typename OT, typename BT>
void int4_rows(const int8_t* q, int64_t num_tokens, int64_t k, int64_t group, const uint8_t* w, int64_t w_stride,
               int64_t n, const float* w_scale, const float* x_scale, const BT* bias, OT* out, int64_t out_stride) {
  // SPARSEVER_CPU_INT8_VNNI=0 takes the portable loop (tests of it on VNNI CPUs).
  const bool vnni = int8_vnni_available() && env_switch_on("SPARSEVER_CPU_INT8_VNNI");
  const int64_t groups = k / group;
  // Rows two at a time from 4 tokens on, where groups are one block (int4 checkpoints' 128): each token's
  // loads shared by both rows. From DRAM 1.23x one row at a time at 8 tokens, 0.83x at 1 (two streams
  // prefetched less well). Measured: bench/results, pass_linears_zen5-int4-*.
  const bool two_rows = num_tokens >= 4 && group == kInt4Block;
  std::vector<int32_t> offset(vnni ? num_tokens * (k / kInt4Block) * 16 : 0);
  if (vnni) lane_offsets(q, num_tokens, k, offset.data());
  auto store = [&](int64_t r, const float* acc) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      float y = acc[t] * x_scale[t];
      if (bias) y += static_cast<float>(bias[r]);
      out[t * out_stride + r] = static_cast<OT>(y);
    }
  };
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(2 * num_tokens), tile(8);
    int64_t r = r0;
#if defined(CPU_CAPABILITY_AVX512)
    if (vnni && two_rows)
      for (; r + 2 <= r1; r += 2) {
        for_each_token_tile(num_tokens, [&](auto nt, int64_t t0) {
          constexpr int NT = decltype(nt)::value;
          dot_two_rows_int4_vnni<NT>(q + t0 * k, offset.data() + t0 * (k / kInt4Block) * 16, k, w + r * w_stride,
                                     w + (r + 1) * w_stride, w_scale + r * groups, w_scale + (r + 1) * groups,
                                     tile.data());
          for (int t = 0; t < NT; ++t) {
            acc[t0 + t] = tile[t];
            acc[num_tokens + t0 + t] = tile[NT + t];
          }
        });
        store(r, acc.data());
        store(r + 1, acc.data() + num_tokens);
      }
#endif
    for (; r < r1; ++r) {
      const uint8_t* row = w + r * w_stride;
      const float* scale = w_scale + r * groups;
#if defined(CPU_CAPABILITY_AVX512)
      if (vnni)
        for_each_token_tile(num_tokens, [&](auto nt, int64_t t0) {
          dot_row_int4_vnni<decltype(nt)::value>(q + t0 * k, offset.data() + t0 * (k / kInt4Block) * 16, k, row,
                                                 scale, group / kInt4Block, acc.data() + t0);
        });
      else
#endif
        dot_row_int4_portable(q, num_tokens, k, row, scale, group, acc.data());
      store(r, acc.data());
    }
  });
}

}  // namespace
}  // namespace sparsever::cpu

void int4_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& weight_scale, const std::optional<torch::Tensor>& bias) {
  using namespace sparsever::cpu;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight_scale.dim() == 2,
              "int4_linear: x [T, K], weight [N, K / 2] and weight_scale [N, K / group], got ", x.sizes(), ", ",
              weight.sizes(), " and ", weight_scale.sizes());
  const int64_t t = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(k % kInt4Block == 0 && weight.size(1) * 2 == k, "int4_linear: K must be a multiple of ", kInt4Block,
              " and weight [N, K / 2] packed bytes, got x ", x.sizes(), " and weight ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.stride(1) == 1,
              "int4_linear: weight must be uint8 (two int4 values a byte) with contiguous rows, got ",
              weight.scalar_type());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.size(0) == n && weight_scale.is_contiguous() &&
                  weight_scale.size(1) > 0 && k % weight_scale.size(1) == 0 &&
                  (k / weight_scale.size(1)) % kInt4Block == 0,
              "int4_linear: weight_scale must be fp32 [N, K / group] with group a multiple of ", kInt4Block, ", got ",
              weight_scale.sizes());
  TORCH_CHECK(x.stride(1) == 1, "int4_linear: x must have contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == t && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "int4_linear: out must be [T, N] in x's dtype with contiguous rows");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()),
              "int4_linear: bias must be [N]");
  if (t == 0 || n == 0) return;
  const int64_t group = k / weight_scale.size(1);
  // quantize_tokens stores q + 128 (int8_linear's unsigned operand); here q is the signed operand
  std::vector<uint8_t> xu(t * k);
  std::vector<float> x_scale(t);
  SPARSEVER_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int4_linear_quantize", [&] {
    quantize_tokens(x.data_ptr<scalar_t>(), t, k, x.stride(0), k, xu.data(), x_scale.data());
  });
  for (auto& v : xu) v ^= 0x80;  // q + 128 -> q as a signed byte
  const auto* q = reinterpret_cast<const int8_t*>(xu.data());
  SPARSEVER_DISPATCH_FLOAT_TYPES(out.scalar_type(), "int4_linear", [&] {
    using OT = scalar_t;
    auto run = [&](const auto* b) {
      int4_rows(q, t, k, group, weight.data_ptr<uint8_t>(), weight.stride(0), n,
                weight_scale.data_ptr<float>(), x_scale.data(), b, out.data_ptr<OT>(), out.stride(0));
    };
    if (!bias.has_value()) {
      run(static_cast<const float*>(nullptr));
    } else {
      SPARSEVER_DISPATCH_FLOAT_TYPES(bias->scalar_type(), "int4_linear_bias", [&] { run(bias->data_ptr<scalar_t>()); });
    }
  });
}
