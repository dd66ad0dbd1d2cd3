// CUDA launchers: MoE routing/pruning and grouped dispatch (bodies in csrc/kernels/moe.cuh).
#include "cuda/cuda_launcher.cuh"
#include "cuda/ops_cuda.h"
#include "kernels/moe.cuh"

namespace sparsever {
namespace cuda {

void moe_route_and_prune(const at::Tensor& router_logits, int64_t top_k, double prune_ratio,
                         const std::optional<at::Tensor>& group_start_loc, int64_t expert_budget, bool renormalize,
                         at::Tensor& topk_weights, at::Tensor& topk_ids) {
  const c10::cuda::OptionalCUDAGuard guard(router_logits.device());
  kernels::moe_route_and_prune_impl(router_logits, top_k, prune_ratio, group_start_loc, expert_budget, renormalize,
                                    topk_weights, topk_ids, CudaLauncher::current());
}

void moe_grouped_dispatch(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                          at::Tensor& num_experts_used) {
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  kernels::moe_grouped_dispatch_impl(out, x, topk_weights, topk_ids, w13, w2, num_experts_used,
                                     CudaLauncher::current());
}

}  // namespace cuda
}  // namespace sparsever
