// C++ declarations of every op in the `sparsever` torch library namespace.
// Schemas live in torch_bindings.cpp; the semantics of each op are defined by its PyTorch reference in
// vllm_sparsever/reference.py; Python wrappers with fake impls are in vllm_sparsever/_custom_ops.py.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "torch_api.h"

// Which ISA build of the extension is loaded ("avx512" or "avx2"); used for diagnostics.
std::string ext_info();

// Whether this build and CPU have AVX512-BF16 (vdpbf16ps), which topk_swiglu_ffn's bf16 projections and
// block_sparse_tree_attention's bf16 path on the plain KV layout use.
bool bf16_dot_available();
bool amx_available();
int64_t amx_emulated_products();
// Whether this build and CPU run int8_linear on AVX512-VNNI dot products (else a portable loop).
bool int8_vnni_available();
std::vector<int64_t> amx_emulated_prefetch_lines();

// ---- CPU implementations (csrc/cpu) ------------------------------------------------------------

// KV block key summaries: exact per-channel min/max of every block touched by slot_mapping.
void update_block_key_summaries_cpu(const torch::Tensor& key_cache, const torch::Tensor& slot_mapping,
                                    int64_t block_size, torch::Tensor& key_min, torch::Tensor& key_max);

// Quest-style block selection per request and KV head (logical block ids, ascending).
void select_kv_blocks_cpu(const torch::Tensor& query_pooled, const torch::Tensor& key_min,
                          const torch::Tensor& key_max, const torch::Tensor& block_table,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_lens, int64_t block_size,
                          int64_t top_k, int64_t num_sink, int64_t num_local, torch::Tensor& selected,
                          torch::Tensor& num_selected);

// Block-sparse tree attention over the paged KV cache (selected=None: dense; tree_mask=None: causal).
void block_sparse_tree_attention_cpu(torch::Tensor& out, const torch::Tensor& query,
                                     const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                                     const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                     const torch::Tensor& query_start_loc,
                                     const std::optional<torch::Tensor>& selected,
                                     const std::optional<torch::Tensor>& num_selected,
                                     const std::optional<torch::Tensor>& tree_mask, double scale);

// SwiGLU MLP over one top-`keep` neuron set per token group.
void topk_swiglu_ffn_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w_gate_up,
                         const torch::Tensor& w_down_t, const torch::Tensor& group_start_loc, int64_t keep,
                         torch::Tensor& selected);

// The same with the gate projection x @ w_gate^T [T, I] given (w_up [I, H]).
void topk_swiglu_ffn_gated_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate,
                               const torch::Tensor& w_up, const torch::Tensor& w_down_t,
                               const torch::Tensor& group_start_loc, int64_t keep, torch::Tensor& selected);

// TEAL-style approximate gate: per group the top-`input_keep` input channels by sum |x|, gate [T, I] from
// those channels' rows of w_gate_t [H, I] only (gate in x's dtype); channels [G, input_keep] int32.
void input_sparse_gate_cpu(torch::Tensor& gate, const torch::Tensor& x, const torch::Tensor& w_gate_t,
                           const torch::Tensor& group_start_loc, int64_t input_keep, torch::Tensor& channels);

// out [T, N] = x [T, K] @ weight^T (+ bias [N]) over plain weights of any float dtype; weight [N, K]
// row-major or a transposed view of a [K, N] tensor.
void dense_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                      const std::optional<torch::Tensor>& bias);

// out [T, N] = W8A8 linear: x quantized per token (symmetric int8, at run time) times int8 weight rows
// [N, K] with one fp32 scale each (+ bias); weight_sum [N] int32 = weight.sum(1).
void int8_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& weight_scale, const torch::Tensor& weight_sum,
                     const std::optional<torch::Tensor>& bias);

// out [T, N] = W4A8 linear: x quantized per token (symmetric int8, at run time) times int4 weight rows
// packed two a byte [N, K / 2] with one fp32 scale per group of input channels [N, K / G] (+ bias).
void int4_linear_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& weight_scale, const std::optional<torch::Tensor>& bias);

// Top-k softmax routing + ratio pruning + optional per-group expert budget.
void moe_route_and_prune_cpu(const torch::Tensor& router_logits, int64_t top_k, double prune_ratio,
                             const std::optional<torch::Tensor>& group_start_loc, int64_t expert_budget,
                             bool renormalize, torch::Tensor& topk_weights, torch::Tensor& topk_ids);

// One SwiGLU expert GEMM per kept expert over its routed tokens; writes the distinct expert count.
void moe_grouped_dispatch_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& topk_weights,
                              const torch::Tensor& topk_ids, const torch::Tensor& w13, const torch::Tensor& w2,
                              torch::Tensor& num_experts_used);
