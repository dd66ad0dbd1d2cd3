// Host-side helpers shared by the launch code of every op (compiled by nvcc for csrc/cuda/*.cu and by the
// host compiler for the SIMT tests). A "launcher" is any callable object with
//     launch(dim3 grid, dim3 block, size_t dynamic_smem_bytes, kernel, args...)
// plus two fields the launch heuristics read:
//     int num_sms        parallelism to fill (SM count on a GPU; small in SIMT tests);
//     int forced_splits  0 = heuristic split-K factor; > 0 forces it (tests exercise every split path);
//     bool tensor_cores  kernels built on mma.sync / ldmatrix / cp.async may run (sm_80+, or emulated).
// csrc/cuda/cuda_launcher.cuh (kernel<<<...>>> on the current stream) and csrc/simt/simt_launcher.h
// (simt::launch) are the two implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "compat.cuh"

namespace sparsever {
namespace kernels {

// float / c10::Half / c10::BFloat16 -> body with `scalar_t` defined.
#define SV_DISPATCH_FLOAT_TYPES(dtype, name, ...)                                       \
  [&] {                                                                                 \
    switch (dtype) {                                                                    \
      case at::ScalarType::Float: {                                                     \
        using scalar_t = float;                                                         \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::Half: {                                                      \
        using scalar_t = c10::Half;                                                     \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::BFloat16: {                                                  \
        using scalar_t = c10::BFloat16;                                                 \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        TORCH_CHECK(false, name, ": unsupported dtype ", dtype, " (float32, float16, bfloat16)"); \
    }                                                                                   \
  }()

// Whether a row-major run of `len` elements starting at every `stride`-th element of `ptr` can be read as
// 16-byte vectors.
inline bool can_vectorize(const void* ptr, int64_t elem_size, int64_t len, std::initializer_list<int64_t> strides) {
  const int64_t vec = 16 / elem_size;
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || len % vec != 0) return false;
  for (int64_t s : strides)
    if (s % vec != 0) return false;
  return true;
}

// Unit stride along `dim`, or a size (0 or 1) for which torch leaves the stride arbitrary.
inline bool unit_stride(const at::Tensor& t, int64_t dim) { return t.size(dim) <= 1 || t.stride(dim) == 1; }

inline void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), name, " is on ", b.device(), ", expected ", a.device());
}

}  // namespace kernels
}  // namespace sparsever
