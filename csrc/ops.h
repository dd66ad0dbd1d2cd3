// C++ declarations of every op in the `sparsever` torch library namespace.
// Schemas (and their semantics) live in torch_bindings.cpp; PyTorch references in
// vllm_sparsever/reference.py; Python wrappers with fake impls in vllm_sparsever/_custom_ops.py.
#pragma once

#include <string>

#include <torch/all.h>

// Which ISA build of the extension is loaded ("avx512" or "avx2"); used for diagnostics.
std::string ext_info();
