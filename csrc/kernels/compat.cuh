// The one header every kernel body includes. Under nvcc it is plain CUDA; in any other compiler it maps the
// CUDA built-ins the kernels use onto the test-only SIMT executor (csrc/simt/simt.h), so the very same
// kernel source runs on the CPU in tests/simt. Kernels must stay inside this vocabulary: no inline PTX
// (or guarded by __CUDA_ARCH__ with a plain fallback), no cub, no cooperative groups.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__CUDACC__)

#include <cuda_runtime.h>

#define SV_DEVICE __device__ __forceinline__
#define SV_HOST_DEVICE __host__ __device__ __forceinline__
// Dynamic shared memory (sized at launch). Always declared as bytes so that every kernel template
// declares the same extern array (differently typed declarations of one name are rejected by nvcc).
#define SV_DYNAMIC_SHARED(T, name)                                  \
  extern __shared__ __align__(16) unsigned char sv_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(sv_dynamic_smem_)

#else  // SIMT executor

#include "../simt/simt.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One copy per OS thread = per running block; see simt.h.
#define __shared__ static thread_local

using simt::dim3;
using simt::uint3;

#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
#define __syncthreads() ::simt::syncthreads(__FILE__, __LINE__)

#define SV_DEVICE inline
#define SV_HOST_DEVICE inline
#define SV_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::simt::dynamic_shared_memory())

inline void __syncwarp(unsigned mask = 0xffffffffu) { ::simt::syncwarp(mask); }
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::simt::shfl_sync(mask, var, src_lane, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::simt::shfl_xor_sync(mask, var, lane_mask, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::simt::shfl_down_sync(mask, var, delta, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::simt::shfl_up_sync(mask, var, delta, width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) { return ::simt::ballot_sync(mask, predicate); }
inline unsigned __match_any_sync(unsigned mask, unsigned value) { return ::simt::match_any_sync(mask, value); }
inline int __any_sync(unsigned mask, int predicate) { return ::simt::ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  return ::simt::ballot_sync(mask, predicate) == ::simt::ballot_sync(mask, 1);
}

template <typename T>
inline T atomicAdd(T* address, T value) { return ::simt::atomic_add(address, value); }
template <typename T>
inline T atomicMax(T* address, T value) { return ::simt::atomic_max(address, value); }
template <typename T>
inline T atomicMin(T* address, T value) { return ::simt::atomic_min(address, value); }
template <typename T>
inline T atomicCAS(T* address, T compare, T value) { return ::simt::atomic_cas(address, compare, value); }
template <typename T>
inline T atomicExch(T* address, T value) { return ::simt::atomic_exch(address, value); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; std::memcpy(&x, &i, 4); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }

#endif  // __CUDACC__

namespace sparsever {
namespace kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
SV_HOST_DEVICE constexpr T div_up(T a, T b) { return (a + b - 1) / b; }
template <typename T>
SV_HOST_DEVICE constexpr T min_of(T a, T b) { return a < b ? a : b; }
template <typename T>
SV_HOST_DEVICE constexpr T max_of(T a, T b) { return a < b ? b : a; }

// Element conversions; c10::Half / c10::BFloat16 convert on host and device alike.
template <typename T>
SV_DEVICE float to_float(T x) { return static_cast<float>(x); }
template <typename T>
SV_DEVICE T from_float(float x) { return static_cast<T>(x); }

// N elements loaded or stored as one access (16 bytes -> one 128-bit load on the GPU).
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVec {
  T val[N];
};

SV_DEVICE float warp_reduce_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

SV_DEVICE float warp_reduce_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduce within groups of `width` lanes (a power of two <= 32); every lane of a group gets the result.
template <int kWidth>
SV_DEVICE float group_reduce_sum(float v) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset, kWidth);
  return v;
}

// Block-wide sum; `scratch` holds one float per warp. All threads get the result.
SV_DEVICE float block_reduce_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = div_up<int>(blockDim.x, kWarpSize);
  v = warp_reduce_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_reduce_sum(v);
}

}  // namespace kernels
}  // namespace sparsever
