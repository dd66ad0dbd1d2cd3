// The part of torch's C++ API the CPU kernels and the op registrations use: tensors, the ATen ops they
// call, parallel_for, the vectorised types and TORCH_LIBRARY. <torch/all.h> would add the autograd, nn
// and optim front end, which nothing here calls and which is most of every file's compile time and of
// its precompiled header (bench/results/README.md, 'Test suite time').
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

// torch::Tensor, torch::kFloat, torch::empty, ... name the ATen ones, as <torch/types.h> makes them do
// (without its fixed-width aliases: torch::kInt, not torch::kInt32).
namespace torch {
using namespace at;  // NOLINT(google-build-using-namespace)
}  // namespace torch
