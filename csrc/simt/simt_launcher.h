// The SIMT launcher for the shared host launch code (csrc/kernels/host_utils.cuh): test builds only.
#pragma once

#include <utility>

#include "simt.h"

namespace simt {

struct Launcher {
  int num_sms = 4;        // small, so the split-K heuristics split even tiny test shapes
  int forced_splits = 0;  // > 0: tests force a split-K factor
  bool tensor_cores = true;  // emulated mma.sync / ldmatrix / cp.async (csrc/kernels/mma.cuh)

  template <typename... Params, typename... Args>
  void operator()(dim3 grid, dim3 block, size_t smem_bytes, void (*kernel)(Params...), Args&&... args) const {
    launch(grid, block, smem_bytes, kernel, std::forward<Args>(args)...);
  }
};

}  // namespace simt
