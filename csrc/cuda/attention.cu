// CUDA launcher: block-sparse tree attention (bodies in csrc/kernels/attention.cuh and
// attention_mma.cuh, host launch code in attention_launch.cuh).
#include "cuda/cuda_launcher.cuh"
#include "cuda/ops_cuda.h"
#include "kernels/attention_launch.cuh"

namespace sparsever {
namespace cuda {

void block_sparse_tree_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                 const std::optional<at::Tensor>& selected,
                                 const std::optional<at::Tensor>& num_selected,
                                 const std::optional<at::Tensor>& tree_mask, double scale) {
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  kernels::block_sparse_tree_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens,
                                            query_start_loc, selected, num_selected, tree_mask, scale,
                                            CudaLauncher::current());
}

}  // namespace cuda
}  // namespace sparsever
