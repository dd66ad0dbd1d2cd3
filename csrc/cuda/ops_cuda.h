// CUDA implementations of the `sparsever` ops (schemas in csrc/torch_bindings.cpp, semantics in
// vllm_sparsever/reference.py). Kernel bodies: csrc/kernels/*.cuh; registration: cuda_bindings.cpp.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace sparsever {
namespace cuda {

void update_block_key_summaries(const at::Tensor& key_cache, const at::Tensor& slot_mapping, int64_t block_size,
                                at::Tensor& key_min, at::Tensor& key_max);

void select_kv_blocks(const at::Tensor& query_pooled, const at::Tensor& key_min, const at::Tensor& key_max,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                      int64_t block_size, int64_t top_k, int64_t num_sink, int64_t num_local, at::Tensor& selected,
                      at::Tensor& num_selected);

void block_sparse_tree_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                 const std::optional<at::Tensor>& selected,
                                 const std::optional<at::Tensor>& num_selected,
                                 const std::optional<at::Tensor>& tree_mask, double scale);

void topk_swiglu_ffn(at::Tensor& out, const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down_t,
                     const at::Tensor& group_start_loc, int64_t keep, at::Tensor& selected);

void topk_swiglu_ffn_gated(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w_up,
                           const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                           at::Tensor& selected);

void input_sparse_gate(at::Tensor& gate, const at::Tensor& x, const at::Tensor& w_gate_t,
                       const at::Tensor& group_start_loc, int64_t input_keep, at::Tensor& channels);

void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const at::Tensor& weight_sum, const std::optional<at::Tensor>& bias);

void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias);

void moe_route_and_prune(const at::Tensor& router_logits, int64_t top_k, double prune_ratio,
                         const std::optional<at::Tensor>& group_start_loc, int64_t expert_budget, bool renormalize,
                         at::Tensor& topk_weights, at::Tensor& topk_ids);

void moe_grouped_dispatch(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                          at::Tensor& num_experts_used);

}  // namespace cuda
}  // namespace sparsever
