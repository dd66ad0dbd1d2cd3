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
// 16-byte weight loads a lane issues before using the first (over all its rows): with one per row in
// flight, a GEMV warp keeps too few bytes in flight to cover DRAM latency at the occupancy its registers allow.
constexpr int kGemvLoadsInFlight = 8;

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
  constexpr int kStep = kWarpSize * kVec;
  // acc += w[.][k..k+kVec) x[.][k..k+kVec) for weights already in registers
  auto accumulate = [&](const float (&wv)[kRows][kVec], int k) {
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
  };
  int k = lane * kVec;
  if constexpr (kVec > 1) {
    // kSteps steps of every row loaded (raw) before any is used.
    constexpr int kSteps = kGemvLoadsInFlight / kRows > 1 ? kGemvLoadsInFlight / kRows : 1;
    for (; k + (kSteps - 1) * kStep < len; k += kSteps * kStep) {
      AlignedVec<TW, kVec> raw[kSteps][kRows];
#pragma unroll
      for (int u = 0; u < kSteps; ++u)
#pragma unroll
        for (int r = 0; r < kRows; ++r) raw[u][r] = *reinterpret_cast<const AlignedVec<TW, kVec>*>(w[r] + k + u * kStep);
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        float wv[kRows][kVec];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int e = 0; e < kVec; ++e) wv[r][e] = to_float(raw[u][r].val[e]);
        accumulate(wv, k + u * kStep);
      }
    }
  }
  for (; k < len; k += kStep) {
    float wv[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_as_float<TW, kVec>(w[r] + k, wv[r]);
    accumulate(wv, k);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kTok; ++t) acc[r][t] = warp_reduce_sum(acc[r][t]);
}

SV_DEVICE float silu(float x) { return x / (1.0f + __expf(-x)); }

}  // namespace kernels
}  // namespace sparsever
