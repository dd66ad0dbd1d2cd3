// CUDA launchers: top-k SwiGLU FFN gating (the gate computed, or given) and the input-sparse gate (bodies in
// csrc/kernels/ffn.cuh); the dense linear (cuBLAS).
#include <ATen/ops/linear.h>

#include "cuda/cuda_launcher.cuh"
#include "cuda/ops_cuda.h"
#include "kernels/ffn.cuh"
#include "kernels/int4_linear.cuh"
#include "kernels/int8_linear.cuh"

namespace sparsever {
namespace cuda {

void topk_swiglu_ffn(at::Tensor& out, const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down_t,
                     const at::Tensor& group_start_loc, int64_t keep, at::Tensor& selected) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::topk_swiglu_ffn_impl(out, x, w_gate_up, w_down_t, group_start_loc, keep, selected,
                                CudaLauncher::current());
}

void topk_swiglu_ffn_gated(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w_up,
                           const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                           at::Tensor& selected) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::topk_swiglu_ffn_gated_impl(out, x, gate, w_up, w_down_t, group_start_loc, keep, selected,
                                      CudaLauncher::current());
}

void input_sparse_gate(at::Tensor& gate, const at::Tensor& x, const at::Tensor& w_gate_t,
                       const at::Tensor& group_start_loc, int64_t input_keep, at::Tensor& channels) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::input_sparse_gate_impl(gate, x, w_gate_t, group_start_loc, input_keep, channels, CudaLauncher::current());
}

// A dense linear has nothing to skip on a GPU: cuBLAS (ATen's linear), here so the op runs everywhere.
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  out.copy_(at::linear(x, weight.to(x.scalar_type()), bias.has_value() ? bias->to(x.scalar_type()) : bias));
}

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const at::Tensor& weight_sum, const std::optional<at::Tensor>& bias) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::int8_linear_impl(out, x, weight, weight_scale, weight_sum, bias, CudaLauncher::current());
}

void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::int4_linear_impl(out, x, weight, weight_scale, bias, CudaLauncher::current());
}

}  // namespace cuda
}  // namespace sparsever
