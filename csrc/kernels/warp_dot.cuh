// Dot products of a few weight rows with a few activation rows by one warp: the building block of the
// FFN and MoE kernels. At verification batch sizes these are weight-streaming GEMVs: each weight element
// is loaded once (kVec elements = 16 bytes per lane per step) and reused for up to kTok tokens.
#pragma once

#include "compat.cuh"

namespace sparsever {
namespace kernels {

// CTA shape of the GEMV kernels built on warp_dot_rows_tokens (FFN and MoE).
constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * kWarpSize;
constexpr int kGemvRowsPerWarp = 2;
constexpr int kGemvRowsPerCta = kGemvWarps * kGemvRowsPerWarp;
constexpr int kGemvTokens = 8;  // tokens per weight pass (register accumulators: rows * tokens per lane)
static_assert(kGemvRowsPerWarp * kGemvTokens <= kWarpSize, "one lane writes each (row, token) result");

template <typename T, int kVec>
SV_DEVICE void load_as_float(const T* p, float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    v[0] = to_float(p[0]);
  } else {
    AlignedVec<T, kVec> raw = *reinterpret_cast<const AlignedVec<T, kVec>*>(p);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = to_float(raw.val[e]);
  }
}

// acc[r][t] = dot(w[r][0..len), x[t][0..len)) for t < ntok, summed over the warp (every lane gets it).
// Pointers must be valid for every r and t < ntok; with kVec > 1, 16-byte aligned and len % kVec == 0.
template <int kRows, int kTok, int kVec, typename TW, typename TX>
SV_DEVICE void warp_dot_rows_tokens(const TW* const (&w)[kRows], const TX* const (&x)[kTok], int ntok, int len,
                                    float (&acc)[kRows][kTok]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kTok; ++t) acc[r][t] = 0.0f;
  for (int k = lane * kVec; k < len; k += kWarpSize * kVec) {
    float wv[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_as_float<TW, kVec>(w[r] + k, wv[r]);
#pragma unroll
    for (int t = 0; t < kTok; ++t) {
      if (t < ntok) {
        float xv[kVec];
        load_as_float<TX, kVec>(x[t] + k, xv);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[r][t] = fmaf(wv[r][e], xv[e], acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kTok; ++t) acc[r][t] = warp_reduce_sum(acc[r][t]);
}

SV_DEVICE float silu(float x) { return x / (1.0f + __expf(-x)); }

}  // namespace kernels
}  // namespace sparsever
