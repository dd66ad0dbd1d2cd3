// The CUDA launcher for the shared host launch code (csrc/kernels/host_utils.cuh): kernel<<<...>>> on the
// current stream of the tensors' device, with the dynamic shared memory opt-in above 48 KiB.
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace sparsever {
namespace cuda {

struct CudaLauncher {
  cudaStream_t stream;
  int num_sms;
  int forced_splits = 0;
  // mma.sync / ldmatrix / cp.async kernels may run: sm_80 or later, and not switched off with
  // SPARSEVER_CUDA_ATTENTION=cuda_cores (the GPU kit times both paths in one run).
  bool tensor_cores = false;

  static CudaLauncher current() {
    int device = c10::cuda::current_device();
    int sms = 0, major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    const char* mode = std::getenv("SPARSEVER_CUDA_ATTENTION");
    const bool cuda_cores = mode != nullptr && std::strcmp(mode, "cuda_cores") == 0;
    return CudaLauncher{c10::cuda::getCurrentCUDAStream().stream(), sms, 0, major >= 8 && !cuda_cores};
  }

  template <typename... Params, typename... Args>
  void operator()(dim3 grid, dim3 block, size_t smem_bytes, void (*kernel)(Params...), Args&&... args) const {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
    if (smem_bytes > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)));
    }
    kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace cuda
}  // namespace sparsever
