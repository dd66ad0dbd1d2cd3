// CUDA launchers: KV block key summaries and block selection (bodies in csrc/kernels/kv_selection.cuh).
#include "cuda/cuda_launcher.cuh"
#include "cuda/ops_cuda.h"
#include "kernels/kv_selection.cuh"

namespace sparsever {
namespace cuda {

void update_block_key_summaries(const at::Tensor& key_cache, const at::Tensor& slot_mapping, int64_t block_size,
                                at::Tensor& key_min, at::Tensor& key_max) {
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  kernels::update_block_key_summaries_impl(key_cache, slot_mapping, block_size, key_min, key_max,
                                           CudaLauncher::current());
}

void select_kv_blocks(const at::Tensor& query_pooled, const at::Tensor& key_min, const at::Tensor& key_max,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                      int64_t block_size, int64_t top_k, int64_t num_sink, int64_t num_local, at::Tensor& selected,
                      at::Tensor& num_selected) {
  const c10::cuda::OptionalCUDAGuard guard(query_pooled.device());
  kernels::select_kv_blocks_impl(query_pooled, key_min, key_max, block_table, seq_lens, query_lens, block_size, top_k,
                                 num_sink, num_local, selected, num_selected, CudaLauncher::current());
}

}  // namespace cuda
}  // namespace sparsever
