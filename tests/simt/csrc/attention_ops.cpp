// Test-only ops (namespace sparsever_simt) that run the CUDA kernel bodies of KV selection and
// block-sparse tree attention on the SIMT executor, through the same host launch code as csrc/cuda.
// Each op takes the production schema plus `forced_splits` (0 = heuristic) and `num_sms`; attention also
// `tensor_cores` (false: the CUDA-core kernel even where the tensor-core one applies).
#include <torch/library.h>

#include "kernels/attention_launch.cuh"
#include "kernels/kv_selection.cuh"
#include "simt/simt_launcher.h"

namespace {

simt::Launcher launcher(int64_t num_sms, int64_t forced_splits, bool tensor_cores = true) {
  simt::Launcher l;
  l.num_sms = int(num_sms);
  l.forced_splits = int(forced_splits);
  l.tensor_cores = tensor_cores;
  return l;
}

// [mma.sync tiles, ldmatrix instructions, cp.async bytes, kernel launches] the executor has run so far.
std::vector<int64_t> emulated_instructions() {
  const simt::Counters& c = simt::counters();
  return {int64_t(c.mma.load()), int64_t(c.ldmatrix.load()), int64_t(c.async_bytes.load()),
          int64_t(c.launches.load())};
}

void update_block_key_summaries(const at::Tensor& key_cache, const at::Tensor& slot_mapping, int64_t block_size,
                                at::Tensor& key_min, at::Tensor& key_max) {
  sparsever::kernels::update_block_key_summaries_impl(key_cache, slot_mapping, block_size, key_min, key_max,
                                                      launcher(4, 0));
}

void select_kv_blocks(const at::Tensor& query_pooled, const at::Tensor& key_min, const at::Tensor& key_max,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                      int64_t block_size, int64_t top_k, int64_t num_sink, int64_t num_local, at::Tensor& selected,
                      at::Tensor& num_selected) {
  sparsever::kernels::select_kv_blocks_impl(query_pooled, key_min, key_max, block_table, seq_lens, query_lens,
                                            block_size, top_k, num_sink, num_local, selected, num_selected,
                                            launcher(4, 0));
}

void block_sparse_tree_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                 const std::optional<at::Tensor>& selected,
                                 const std::optional<at::Tensor>& num_selected,
                                 const std::optional<at::Tensor>& tree_mask, double scale, int64_t num_sms,
                                 int64_t forced_splits, bool tensor_cores) {
  sparsever::kernels::block_sparse_tree_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens,
                                                       query_start_loc, selected, num_selected, tree_mask, scale,
                                                       launcher(num_sms, forced_splits, tensor_cores));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsever_simt, m) {
  m.def(
      "update_block_key_summaries(Tensor key_cache, Tensor slot_mapping, int block_size, "
      "Tensor(a!) key_min, Tensor(b!) key_max) -> ()",
      &update_block_key_summaries);
  m.def(
      "select_kv_blocks(Tensor query_pooled, Tensor key_min, Tensor key_max, Tensor block_table, "
      "Tensor seq_lens, Tensor query_lens, int block_size, int top_k, int num_sink, int num_local, "
      "Tensor(a!) selected, Tensor(b!) num_selected) -> ()",
      &select_kv_blocks);
  m.def(
      "block_sparse_tree_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor? selected, "
      "Tensor? num_selected, Tensor? tree_mask, float scale, int num_sms=4, int forced_splits=0, bool tensor_cores=True) -> ()",
      &block_sparse_tree_attention);
  m.def("emulated_instructions() -> int[]", &emulated_instructions);
}
