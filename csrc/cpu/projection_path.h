// Shared by the FFN and MoE CPU ops (ffn.cpp, moe.cpp): from how many tokens a projection leaves the
// weight-streaming kernels for an ATen GEMM, and the environment switches of the streaming path.
#pragma once

#include "cpu_utils.h"
#include "gemv_rows_bf16.h"

#include <cpuid.h>

#include <cstdlib>
#include <limits>
#include <type_traits>

namespace sparsever::cpu {

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

// bf16 weights on a CPU with AVX512-BF16: stream them with vdpbf16ps (gemv_rows_bf16.h) instead of
// widening to fp32. SPARSEVER_CPU_FFN_BF16_DOT=0 turns it off.
inline bool use_bf16_dot() { return rows_bf16_available() && env_switch_on("SPARSEVER_CPU_FFN_BF16_DOT"); }

// rows_dot_range_bf16's prefetch spread over token tiles: faster than prefetching in the first token
// tile only at 8-16 tokens (docs/kernels.md, 2026-11-26). SPARSEVER_CPU_FFN_SPREAD_PREFETCH=0 turns it
// off.
inline bool spread_prefetch() { return env_switch_on("SPARSEVER_CPU_FFN_SPREAD_PREFETCH"); }

}  // namespace sparsever::cpu
