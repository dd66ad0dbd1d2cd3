// dense_linear on CPU: out = x @ weight^T (+ bias) over plain (unpacked) weights of any float dtype, for
// CPUs where vLLM-CPU's 16-bit linear is torch's (no AVX-512: docs/kernels.md, "AVX2"). Two paths:
// - few tokens: the weight rows are streamed once and reused for every token (rows_dot / rows_axpy of
//   gemv_rows.h), so the time is the weights' read time;
// - more tokens: the weight is widened to fp32 a panel at a time and multiplied by ATen's fp32 GEMM,
//   which on such CPUs runs several times faster than its 16-bit one.
// The weight is [N, K] either row-major (a linear layer's weight) or column-major (a transposed view of
// a [K, N] tensor, as the FFN's shared down projection keeps it).
// On CPUs with AMX, bf16 row-major weights at up to 16 tokens stream through AMX tiles instead (below).
#include "cpu_utils.h"
#include "gemv_rows.h"
#include "gemv_rows_bf16.h"

#if defined(CPU_CAPABILITY_AVX512)
#include "amx_tiles.h"
#endif

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace sparsever::cpu {
namespace {

// Up to this many tokens the weights are streamed: measured faster than the widened GEMM up to 64 tokens
// on an AVX2 CPU for Qwen2.5-1.5B's projections and LM head (bench/kernels/linear_ab.py, which sets
// SPARSEVER_CPU_LINEAR_STREAM_MAX to time both paths).
int64_t stream_max_tokens() {
  const char* env = std::getenv("SPARSEVER_CPU_LINEAR_STREAM_MAX");
  if (env) return std::max<int64_t>(0, std::atoll(env));
  return 64;
}

// fp32 elements per widened panel: a few MiB, so a panel stays in L2/L3 between its conversion and GEMM.
constexpr int64_t kPanelElems = int64_t(1) << 20;

#if defined(CPU_CAPABILITY_AVX512)
// Few tokens on AMX: Y^T [N, T] = W [N, K] X^T. A tiles are the weight's own rows (16 rows x 32 bf16,
// loaded in place with the row stride: nothing is packed), the tokens one B tile per 32-deep slice
// (pairs along K, T columns), two 16-row groups per step. The tile products take a fraction of the
// weight's read time at any T up to 16, where vdpbf16ps rows (rows_dot_range_bf16) cost more with every
// token and re-read the weight past 4 tokens; at 1-2 tokens those stream as fast or faster (measured:
// bench/results, linear_ab_xeon-*-amx). SPARSEVER_CPU_LINEAR_AMX=0 keeps the vdpbf16ps rows (to time both).
constexpr int64_t kAmxMinTokens = 3;
constexpr int64_t kAmxMaxTokens = 16;

bool amx_linear_fits(int64_t t, int64_t k, bool emulate) {
  const char* env = std::getenv("SPARSEVER_CPU_LINEAR_AMX");
  if (env && env[0] == '0') return false;
  return t >= kAmxMinTokens && t <= kAmxMaxTokens && k % amx::kBf16PerRow == 0 && amx::tiles_usable(emulate);
}

// Rows [r0, r1) (a multiple of 16 rows) of Y [T, ys] from the VNNI-paired tokens xp [K / 2][T].
template <typename Tiles>
SPARSEVER_AMX void amx_rows_dot(const uint32_t* xp, int64_t t, int64_t k, const uint16_t* w, int64_t ws,
                                int64_t r0, int64_t r1, float* y, int64_t ys) {
  amx::TileConfig cfg;
  for (int i : {0, 1}) {  // A: 16 weight rows x 64 bytes
    cfg.rows[i] = amx::kTileRows;
    cfg.colsb[i] = amx::kTileBytes;
  }
  for (int i : {2, 4, 5}) {  // B: 16 pairs x T tokens; C: 16 rows x T tokens (fp32)
    cfg.rows[i] = amx::kTileRows;
    cfg.colsb[i] = static_cast<uint16_t>(4 * t);
  }
  Tiles::configure(cfg);
  const int64_t a_stride = ws * static_cast<int64_t>(sizeof(uint16_t)), b_stride = 4 * t;
  const int64_t slices = k / amx::kBf16PerRow;
  alignas(64) float c[2][amx::kTileRows * kAmxMaxTokens];
  for (int64_t r = r0; r < r1; r += 32) {
    const bool two = r + 32 <= r1;
    const uint16_t* a0 = w + r * ws;
    const uint16_t* a1 = a0 + amx::kTileRows * ws;
    const int64_t next_end = std::min(r1, r + 64);  // the next step's rows: one line of each per slice
    Tiles::template zero<4>();
    if (two) Tiles::template zero<5>();
    for (int64_t s = 0; s < slices; ++s) {
      for (int64_t i = r + 32; i < next_end; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * ws + s * amx::kBf16PerRow), _MM_HINT_T0);
      Tiles::template load<2>(xp + s * amx::kTileRows * t, b_stride);
      Tiles::template load<0>(a0 + s * amx::kBf16PerRow, a_stride);
      Tiles::template dot_bf16<4, 0, 2>();
      if (two) {
        Tiles::template load<1>(a1 + s * amx::kBf16PerRow, a_stride);
        Tiles::template dot_bf16<5, 1, 2>();
      }
    }
    Tiles::template store<4>(c[0], b_stride);
    if (two) Tiles::template store<5>(c[1], b_stride);
    for (int g = 0; g < (two ? 2 : 1); ++g)
      for (int i = 0; i < amx::kTileRows; ++i)
        for (int64_t j = 0; j < t; ++j) y[j * ys + r + g * amx::kTileRows + i] = c[g][i * t + j];
  }
  Tiles::release();
}
#endif

template <typename WT>
void stream(const torch::Tensor& xf, const torch::Tensor& weight, bool row_major, float* y) {
  const int64_t t = xf.size(0), k = xf.size(1), n = weight.size(0);
  const WT* w = weight.data_ptr<WT>();
  if (row_major) {
    if constexpr (std::is_same_v<WT, c10::BFloat16>) {
      if (rows_bf16_available()) {  // vdpbf16ps (or AMX) on the bf16-rounded activations
        auto xb = xf.to(torch::kBFloat16).contiguous();
        const auto* xp = reinterpret_cast<const c10::BFloat16*>(xb.data_ptr());
#if defined(CPU_CAPABILITY_AVX512)
        const bool emulate = amx::emulation_enabled();  // tests: the tiles in software (amx_tiles.h)
        if (amx_linear_fits(t, k, emulate)) {
          std::vector<uint32_t> pairs(static_cast<size_t>(k / 2 * t));  // [K / 2][T]: (x[j, 2q], x[j, 2q + 1])
          const auto* xu = reinterpret_cast<const uint16_t*>(xp);
          for (int64_t j = 0; j < t; ++j)
            for (int64_t q = 0; q < k / 2; ++q)
              pairs[q * t + j] = static_cast<uint32_t>(xu[j * k + 2 * q]) |
                                 static_cast<uint32_t>(xu[j * k + 2 * q + 1]) << 16;
          const auto* wu = reinterpret_cast<const uint16_t*>(w);
          parallel_row_tasks(n, k, sizeof(WT), [&](int64_t r0, int64_t r1) {
            const int64_t r16 = r0 + (r1 - r0) / amx::kTileRows * amx::kTileRows;
            const auto rows_dot = emulate ? amx_rows_dot<amx::Emulated> : amx_rows_dot<amx::Hardware>;
            if (r16 > r0) rows_dot(pairs.data(), t, k, wu, weight.stride(0), r0, r16, y, n);
            if (r1 > r16) rows_dot_range_bf16(xp, t, k, w, weight.stride(0), nullptr, r16, r1, y, n);
          });
          return;
        }
#endif
        parallel_row_tasks(n, k, sizeof(WT), [&](int64_t r0, int64_t r1) {
          rows_dot_range_bf16(xp, t, k, w, weight.stride(0), nullptr, r0, r1, y, n);
        });
        return;
      }
    }
    rows_dot<WT>(xf.data_ptr<float>(), t, k, w, weight.stride(0), nullptr, n, y, n);
  } else {  // storage [K, N]: out[t, :] = sum_j x[t, j] * storage[j, :]
    rows_axpy<WT>(xf.data_ptr<float>(), t, k, w, weight.stride(1), nullptr, n, y);
  }
}

void widened_gemm(const torch::Tensor& xf, const torch::Tensor& weight, bool row_major, torch::Tensor& y) {
  const int64_t k = xf.size(1), n = weight.size(0);
  if (row_major) {  // panels of output columns: y[:, n0:n1] = x @ W[n0:n1]^T
    const int64_t rows = std::max<int64_t>(64, kPanelElems / std::max<int64_t>(1, k));
    for (int64_t n0 = 0; n0 < n; n0 += rows) {
      const int64_t len = std::min(rows, n - n0);
      auto panel = weight.narrow(0, n0, len).to(torch::kFloat);
      y.narrow(1, n0, len).copy_(at::mm(xf, panel.t()));
    }
  } else {  // panels of the reduction: y += x[:, k0:k1] @ storage[k0:k1]
    const auto storage = weight.t();  // [K, N], row-major
    const int64_t rows = std::max<int64_t>(64, kPanelElems / std::max<int64_t>(1, n));
    y.zero_();
    for (int64_t k0 = 0; k0 < k; k0 += rows) {
      const int64_t len = std::min(rows, k - k0);
      y.addmm_(xf.narrow(1, k0, len), storage.narrow(0, k0, len).to(torch::kFloat));
    }
  }
}

}  // namespace
}  // namespace sparsever::cpu

bool amx_available() {
#if defined(CPU_CAPABILITY_AVX512)
  return sparsever::cpu::amx::amx_usable();
#else
  return false;
#endif
}

int64_t amx_emulated_products() {
#if defined(CPU_CAPABILITY_AVX512)
  return sparsever::cpu::amx::Emulated::products().load();
#else
  return 0;
#endif
}

std::vector<int64_t> amx_emulated_prefetch_lines() {
#if defined(CPU_CAPABILITY_AVX512)
  using sparsever::cpu::amx::Emulated;
  return {Emulated::prefetched_lines().load(), Emulated::prefetched_lines_loaded().load()};
#else
  return {0, 0};
#endif
}

void dense_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                      const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [T, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  const int64_t t = x.size(0), k = x.size(1), n = weight.size(0);
  const bool row_major = weight.stride(1) == 1 && (n <= 1 || weight.stride(0) >= k);
  const bool col_major = !row_major && weight.stride(0) == 1 && (k <= 1 || weight.stride(1) >= n);
  TORCH_CHECK(row_major || col_major,
              "weight must be [N, K] with contiguous rows, or a transposed view of a [K, N] tensor with "
              "contiguous rows; got strides ", weight.strides());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == t && out.size(1) == n && out.is_contiguous(),
              "out must be contiguous [T, N]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "bias must be [N]");
  if (t == 0 || n == 0) return;
  auto xf = x.to(torch::kFloat).contiguous();
  torch::Tensor y = out.scalar_type() == torch::kFloat ? out : torch::empty({t, n}, torch::kFloat);
  if (k == 0) {
    y.zero_();
  } else if (t <= sparsever::cpu::stream_max_tokens()) {
    SPARSEVER_DISPATCH_FLOAT_TYPES(weight.scalar_type(), "dense_linear_cpu", [&] {
      sparsever::cpu::stream<scalar_t>(xf, weight, row_major, y.data_ptr<float>());
    });
  } else {
    sparsever::cpu::widened_gemm(xf, weight, row_major, y);
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat));
  if (!y.is_same(out)) out.copy_(y);
}
