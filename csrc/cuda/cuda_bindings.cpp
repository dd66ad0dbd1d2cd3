// CUDA implementations of the `sparsever` ops, registered for the CUDA dispatch key. The op schemas are
// defined once in csrc/torch_bindings.cpp (TORCH_LIBRARY); this file is compiled only in CUDA builds.
#include <torch/library.h>

#include "cuda/ops_cuda.h"

TORCH_LIBRARY_IMPL(sparsever, CUDA, m) {
  m.impl("update_block_key_summaries", &sparsever::cuda::update_block_key_summaries);
  m.impl("select_kv_blocks", &sparsever::cuda::select_kv_blocks);
  m.impl("block_sparse_tree_attention", &sparsever::cuda::block_sparse_tree_attention);
  m.impl("topk_swiglu_ffn", &sparsever::cuda::topk_swiglu_ffn);
  m.impl("topk_swiglu_ffn_gated", &sparsever::cuda::topk_swiglu_ffn_gated);
  m.impl("input_sparse_gate", &sparsever::cuda::input_sparse_gate);
  m.impl("dense_linear", &sparsever::cuda::dense_linear);
  m.impl("int8_linear", &sparsever::cuda::int8_linear);
  m.impl("int4_linear", &sparsever::cuda::int4_linear);
  m.impl("moe_route_and_prune", &sparsever::cuda::moe_route_and_prune);
  m.impl("moe_grouped_dispatch", &sparsever::cuda::moe_grouped_dispatch);
}
