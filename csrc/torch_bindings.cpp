// The one TORCH_LIBRARY of the project: every op of the `sparsever` namespace is defined here,
// CPU implementations are registered here, CUDA implementations in cuda/cuda_bindings.cpp.
// Semantics (shapes, dtypes, masks, tie-breaking) are defined by vllm_sparsever/reference.py.
// vLLM style: outputs are mutated arguments (Tensor(a!)), ops return nothing.
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
  // Whether topk_swiglu_ffn's bf16 path uses AVX512-BF16 dot instructions on this CPU.
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);
  // Whether this build and CPU run bf16 tiles (AMX): dense_linear's few-token path and the AMX attention.
  m.def("amx_available() -> bool", &amx_available);
  // Whether int8_linear runs on AVX512-VNNI dot products here (else a portable loop, far slower).
  m.def("int8_vnni_available() -> bool", &int8_vnni_available);
  // Tile products run on the emulated tiles (SPARSEVER_CPU_AMX_EMULATE=1) in this process: tests check
  // that the AMX path ran.
  m.def("amx_emulated_products() -> int", &amx_emulated_products);
  // [lines prefetched through the emulated tiles, of them those a tile load of the same thread read at
  // least 16 tile loads later]: tests check the AMX attention's prefetch schedule.
  m.def("amx_emulated_prefetch_lines() -> int[]", &amx_emulated_prefetch_lines);

  // key_cache [nb, Hkv, bs, D] strided view; slot_mapping [N] int32/int64 (negative = skip);
  // key_min/key_max [nb, Hkv, D] fp32: exact recompute of every touched block over offsets 0..last.
  m.def(
      "update_block_key_summaries(Tensor key_cache, Tensor slot_mapping, int block_size, "
      "Tensor(a!) key_min, Tensor(b!) key_max) -> ()");

  // query_pooled [R, Hq, D]; block_table [R, max_blocks] int32; seq_lens/query_lens [R] int32;
  // selected [R, Hkv, S] int32 (logical block ids ascending, -1 padded); num_selected [R, Hkv] int32.
  m.def(
      "select_kv_blocks(Tensor query_pooled, Tensor key_min, Tensor key_max, Tensor block_table, "
      "Tensor seq_lens, Tensor query_lens, int block_size, int top_k, int num_sink, int num_local, "
      "Tensor(a!) selected, Tensor(b!) num_selected) -> ()");

  // out/query [T, Hq, D]; key_cache/value_cache [nb, Hkv, bs, D] strided views; block_table int32;
  // seq_lens [R] int32; query_start_loc [R+1] int32; selected/num_selected from select_kv_blocks or None
  // (dense); tree_mask [T, max_q_len] bool/uint8 or None (causal chain).
  m.def(
      "block_sparse_tree_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor? selected, "
      "Tensor? num_selected, Tensor? tree_mask, float scale) -> ()");

  // out/x [T, H]; w_gate_up [2I, H]; w_down_t [I, H]; group_start_loc [G+1] int32; selected [G, keep] int32.
  m.def(
      "topk_swiglu_ffn(Tensor(a!) out, Tensor x, Tensor w_gate_up, Tensor w_down_t, "
      "Tensor group_start_loc, int keep, Tensor(b!) selected) -> ()");
  // The same with the gate projection given: gate [T, I] = x @ w_gate^T (any float dtype, e.g. from the
  // target's packed dense GEMM); w_up [I, H].
  m.def(
      "topk_swiglu_ffn_gated(Tensor(a!) out, Tensor x, Tensor gate, Tensor w_up, Tensor w_down_t, "
      "Tensor group_start_loc, int keep, Tensor(b!) selected) -> ()");

  // An approximate gate from the top `input_keep` input channels per group (TEAL-style): gate [T, I] out
  // (x's dtype); x [T, H]; w_gate_t [H, I] = gate_proj.weight.T; channels [G, input_keep] int32 out.
  m.def(
      "input_sparse_gate(Tensor(a!) gate, Tensor x, Tensor w_gate_t, Tensor group_start_loc, "
      "int input_keep, Tensor(b!) channels) -> ()");

  // out [T, N] = x [T, K] @ weight^T (+ bias [N]): every token, every output (a plain dense linear);
  // weight [N, K] with contiguous rows, or a transposed view of a [K, N] tensor with contiguous rows.
  m.def("dense_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");

  // out [T, N] (x's dtype) = a W8A8 linear (an int8 draft model's): x [T, K] quantized per token to
  // symmetric int8 at run time, weight [N, K] int8 with contiguous rows, weight_scale [N] fp32 (one per
  // row), weight_sum [N] int32 = weight.sum(1), bias [N] or None.
  m.def(
      "int8_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_sum, "
      "Tensor? bias) -> ()");

  // out [T, N] (x's dtype) = a W4A8 linear (an int4 draft model's): x [T, K] quantized per token to
  // symmetric int8 at run time, weight [N, K / 2] uint8 (two int4 values a byte, reference.unpack_int4_rows's
  // layout) with contiguous rows, weight_scale [N, K / G] fp32 (one per group of G input channels, G a
  // multiple of 128), bias [N] or None.
  m.def("int4_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> ()");

  // router_logits [T, E]; group_start_loc [G+1] int32 or None; topk_weights [T, K] fp32;
  // topk_ids [T, K] int32 (-1 = pruned).
  m.def(
      "moe_route_and_prune(Tensor router_logits, int top_k, float prune_ratio, Tensor? group_start_loc, "
      "int expert_budget, bool renormalize, Tensor(a!) topk_weights, Tensor(b!) topk_ids) -> ()");

  // out/x [T, H]; topk_weights [T, K] fp32; topk_ids [T, K] int32/int64; w13 [E, 2I, H]; w2 [E, H, I];
  // num_experts_used [1] int32 (distinct experts run).
  m.def(
      "moe_grouped_dispatch(Tensor(a!) out, Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, "
      "Tensor w2, Tensor(b!) num_experts_used) -> ()");
}

TORCH_LIBRARY_IMPL(sparsever, CPU, m) {
  m.impl("update_block_key_summaries", &update_block_key_summaries_cpu);
  m.impl("select_kv_blocks", &select_kv_blocks_cpu);
  m.impl("block_sparse_tree_attention", &block_sparse_tree_attention_cpu);
  m.impl("topk_swiglu_ffn", &topk_swiglu_ffn_cpu);
  m.impl("topk_swiglu_ffn_gated", &topk_swiglu_ffn_gated_cpu);
  m.impl("input_sparse_gate", &input_sparse_gate_cpu);
  m.impl("dense_linear", &dense_linear_cpu);
  m.impl("int8_linear", &int8_linear_cpu);
  m.impl("int4_linear", &int4_linear_cpu);
  m.impl("moe_route_and_prune", &moe_route_and_prune_cpu);
  m.impl("moe_grouped_dispatch", &moe_grouped_dispatch_cpu);
}

SPARSEVER_REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
