// The one TORCH_LIBRARY of the project: every op of the `sparsever` namespace is defined here,
// CPU implementations are registered here, CUDA implementations in cuda/cuda_bindings.cpp.
#include "ops.h"
#include "registration.h"

#include <torch/library.h>

std::string ext_info() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#else
  return "avx2";
#endif
}

TORCH_LIBRARY(sparsever, m) {
  // No tensor arguments, so a catch-all kernel rather than a per-device one.
  m.def("ext_info() -> str", &ext_info);
}

SPARSEVER_REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
