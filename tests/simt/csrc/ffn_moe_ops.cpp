// Test-only ops (namespace sparsever_simt) running the FFN gating, input-sparse gate, MoE and int8 linear CUDA kernel bodies on the SIMT
// executor through the same host launch code as csrc/cuda. Extra trailing arguments: num_sms and
// forced_splits (0 = heuristic), so tests reach every split path.
#include <torch/library.h>

#include "kernels/ffn.cuh"
#include "kernels/int4_linear.cuh"
#include "kernels/int8_linear.cuh"
#include "kernels/moe.cuh"
#include "simt/simt_launcher.h"

namespace {

simt::Launcher launcher(int64_t num_sms, int64_t forced_splits) {
  simt::Launcher l;
  l.num_sms = int(num_sms);
  l.forced_splits = int(forced_splits);
  return l;
}

void topk_swiglu_ffn(at::Tensor& out, const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down_t,
                     const at::Tensor& group_start_loc, int64_t keep, at::Tensor& selected, int64_t num_sms,
                     int64_t forced_splits) {
  sparsever::kernels::topk_swiglu_ffn_impl(out, x, w_gate_up, w_down_t, group_start_loc, keep, selected,
                                           launcher(num_sms, forced_splits));
}

void topk_swiglu_ffn_gated(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w_up,
                           const at::Tensor& w_down_t, const at::Tensor& group_start_loc, int64_t keep,
                           at::Tensor& selected, int64_t num_sms, int64_t forced_splits) {
  sparsever::kernels::topk_swiglu_ffn_gated_impl(out, x, gate, w_up, w_down_t, group_start_loc, keep, selected,
                                                 launcher(num_sms, forced_splits));
}

void input_sparse_gate(at::Tensor& gate, const at::Tensor& x, const at::Tensor& w_gate_t,
                       const at::Tensor& group_start_loc, int64_t input_keep, at::Tensor& channels, int64_t num_sms,
                       int64_t forced_splits) {
  sparsever::kernels::input_sparse_gate_impl(gate, x, w_gate_t, group_start_loc, input_keep, channels,
                                             launcher(num_sms, forced_splits));
}

void moe_route_and_prune(const at::Tensor& router_logits, int64_t top_k, double prune_ratio,
                         const std::optional<at::Tensor>& group_start_loc, int64_t expert_budget, bool renormalize,
                         at::Tensor& topk_weights, at::Tensor& topk_ids) {
  sparsever::kernels::moe_route_and_prune_impl(router_logits, top_k, prune_ratio, group_start_loc, expert_budget,
                                               renormalize, topk_weights, topk_ids, launcher(4, 0));
}

void moe_grouped_dispatch(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                          at::Tensor& num_experts_used) {
  sparsever::kernels::moe_grouped_dispatch_impl(out, x, topk_weights, topk_ids, w13, w2, num_experts_used,
                                                launcher(4, 0));
}

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const at::Tensor& weight_sum, const std::optional<at::Tensor>& bias) {
  sparsever::kernels::int8_linear_impl(out, x, weight, weight_scale, weight_sum, bias, launcher(4, 0));
}

void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias) {
  sparsever::kernels::int4_linear_impl(out, x, weight, weight_scale, bias, launcher(4, 0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsever_simt, m) {
  m.def(
      "topk_swiglu_ffn(Tensor(a!) out, Tensor x, Tensor w_gate_up, Tensor w_down_t, Tensor group_start_loc, "
      "int keep, Tensor(b!) selected, int num_sms=4, int forced_splits=0) -> ()",
      &topk_swiglu_ffn);
  m.def(
      "topk_swiglu_ffn_gated(Tensor(a!) out, Tensor x, Tensor gate, Tensor w_up, Tensor w_down_t, "
      "Tensor group_start_loc, int keep, Tensor(b!) selected, int num_sms=4, int forced_splits=0) -> ()",
      &topk_swiglu_ffn_gated);
  m.def(
      "input_sparse_gate(Tensor(a!) gate, Tensor x, Tensor w_gate_t, Tensor group_start_loc, int input_keep, "
      "Tensor(b!) channels, int num_sms=4, int forced_splits=0) -> ()",
      &input_sparse_gate);
  m.def(
      "moe_route_and_prune(Tensor router_logits, int top_k, float prune_ratio, Tensor? group_start_loc, "
      "int expert_budget, bool renormalize, Tensor(a!) topk_weights, Tensor(b!) topk_ids) -> ()",
      &moe_route_and_prune);
  m.def(
      "moe_grouped_dispatch(Tensor(a!) out, Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, "
      "Tensor w2, Tensor(b!) num_experts_used) -> ()",
      &moe_grouped_dispatch);
  m.def(
      "int8_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_sum, "
      "Tensor? bias) -> ()",
      &int8_linear);
  m.def("int4_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> ()", &int4_linear);
}
