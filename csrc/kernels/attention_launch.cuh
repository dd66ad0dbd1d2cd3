// Host launch code of block_sparse_tree_attention: checks, split-K factor, and the choice between the
// tensor-core kernel (attention_mma.cuh: bf16/fp16, head_dim 64/128, 16-byte rows, sm_80+) and the
// CUDA-core kernel (attention.cuh: any dtype, head_dim, strides).
#pragma once

#include "attention.cuh"
#include "attention_mma.cuh"

namespace sparsever {
namespace kernels {

// Split-K factor from shapes only (no device read), capped at kMaxAttnSplits.
inline int attention_num_splits(int64_t num_ctas, int64_t max_keys, int num_sms, int forced, int tile_keys) {
  if (forced > 0) return forced;
  const int64_t max_tiles = div_up<int64_t>(max_keys, tile_keys);
  // Enough CTAs for 4 per SM (each CTA loads a tile, then computes: others hide its load latency), at
  // least 2 tiles per split so the partials' write and merge stay small next to the keys read.
  const int64_t want = div_up<int64_t>(4 * int64_t(num_sms), std::max<int64_t>(num_ctas, 1));
  const int64_t cap = std::max<int64_t>(1, max_tiles / 2);
  return int(std::max<int64_t>(1, std::min<int64_t>({want, cap, int64_t(kMaxAttnSplits)})));
}

// CTA shapes by the most query rows a request may have: up to 16 (4 warps x 4 rows), up to 32 (4 x 8),
// more (8 x 8, then row passes).
enum class AttnShape { kNarrow, kRegular, kWide };

template <typename T, int kDPerLane, int kVec, int kWarps, int kRowsPerWarp, class Launcher>
void launch_attention_kernel(const dim3& grid, const AttentionParams& p, const Launcher& launch) {
  launch(grid, dim3(kWarps * kWarpSize), attention_smem_bytes(p.head_dim, kWarps, kRowsPerWarp),
         block_sparse_tree_attention_kernel<T, kDPerLane, kVec, kWarps, kRowsPerWarp>, p);
}

// kVec > 1: head_dim contiguous and 16-byte aligned rows (GPU cache layouts), specialised per head-dim
// width; kVec == 1: any strides (e.g. vLLM-CPU's transposed K), one generic instantiation.
template <typename T, int kDPerLane, int kVec, class Launcher>
void launch_attention(const AttentionParams& p, int num_req, AttnShape shape, const Launcher& launch) {
  const dim3 grid(unsigned(p.num_splits), unsigned(p.num_kv_heads), unsigned(num_req));
  switch (shape) {
    case AttnShape::kNarrow:
      launch_attention_kernel<T, kDPerLane, kVec, kAttnWarps, kAttnRowsPerWarpNarrow>(grid, p, launch);
      break;
    case AttnShape::kRegular:
      launch_attention_kernel<T, kDPerLane, kVec, kAttnWarps, kAttnRowsPerWarp>(grid, p, launch);
      break;
    case AttnShape::kWide:
      launch_attention_kernel<T, kDPerLane, kVec, kAttnWarpsWide, kAttnRowsPerWarp>(grid, p, launch);
      break;
  }
  if (p.num_splits > 1) {
    launch(dim3(unsigned(p.num_heads), unsigned(num_req)), dim3(kCombineWarps * kWarpSize), 0,
           combine_attention_splits_kernel<T>, p);
  }
}

template <class Launcher>
void block_sparse_tree_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_table,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                      const std::optional<at::Tensor>& selected,
                                      const std::optional<at::Tensor>& num_selected,
                                      const std::optional<at::Tensor>& tree_mask, double scale,
                                      const Launcher& launch) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, Hq, D] of equal shape");
  TORCH_CHECK(unit_stride(query, 2) && unit_stride(out, 2), "query/out head_dim must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache/value_cache must be [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() && query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type(),
              "query, out and the caches must share one dtype");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ", head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(head_dim >= 1 && head_dim <= 256, "head_dim must be <= 256, got ", head_dim);
  check_int32(block_table, "block_table");
  check_int32(seq_lens, "seq_lens");
  check_int32(query_start_loc, "query_start_loc");
  TORCH_CHECK(block_table.dim() == 2 && unit_stride(block_table, 1), "block_table rows must be contiguous");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "query_start_loc/seq_lens must be contiguous");
  const int64_t num_req = query_start_loc.numel() - 1;
  TORCH_CHECK(num_req >= 0 && seq_lens.numel() >= num_req && block_table.size(0) >= num_req,
              "seq_lens/block_table must cover every request of query_start_loc");
  TORCH_CHECK(selected.has_value() == num_selected.has_value(), "selected and num_selected go together");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &key_cache, &value_cache, &block_table, &seq_lens, &query_start_loc})
    check_same_device(out, *t, "block_sparse_tree_attention argument");

  AttentionParams p{};
  p.out = out.data_ptr();
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.query = query.data_ptr();
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_stride_b = key_cache.stride(0);
  p.k_stride_h = key_cache.stride(1);
  p.k_stride_t = key_cache.stride(2);
  p.k_stride_d = key_cache.stride(3);
  p.v_stride_b = value_cache.stride(0);
  p.v_stride_h = value_cache.stride(1);
  p.v_stride_t = value_cache.stride(2);
  p.v_stride_d = value_cache.stride(3);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  int64_t max_ctx_keys = block_table.size(1) * block_size;
  if (selected.has_value()) {
    const at::Tensor& sel = *selected;
    const at::Tensor& nsel = *num_selected;
    check_int32(sel, "selected");
    check_int32(nsel, "num_selected");
    TORCH_CHECK(sel.dim() == 3 && sel.size(0) >= num_req && sel.size(1) == num_kv_heads && unit_stride(sel, 2),
                "selected must be [R, Hkv, S] with contiguous rows");
    TORCH_CHECK(nsel.dim() == 2 && nsel.size(0) >= num_req && nsel.size(1) == num_kv_heads,
                "num_selected must be [R, Hkv]");
    check_same_device(out, sel, "selected");
    check_same_device(out, nsel, "num_selected");
    p.selected = sel.data_ptr<int>();
    p.sel_stride_r = sel.stride(0);
    p.sel_stride_h = sel.stride(1);
    p.num_selected = nsel.data_ptr<int>();
    p.ns_stride_r = nsel.stride(0);
    p.ns_stride_h = nsel.stride(1);
    max_ctx_keys = sel.size(2) * block_size;
  }
  at::Tensor mask_u8;
  int64_t max_query_keys = num_tokens;
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kByte, "tree_mask must be bool or uint8");
    TORCH_CHECK(m.dim() == 2 && m.size(0) == num_tokens && unit_stride(m, 1),
                "tree_mask must be [T, max_q_len] with contiguous rows");
    check_same_device(out, m, "tree_mask");
    p.tree_mask = static_cast<const uint8_t*>(m.data_ptr());  // bool is one byte, 0 or 1
    p.mask_stride = m.stride(0);
    max_query_keys = m.size(1);
  }
  p.num_heads = int(num_heads);
  p.num_kv_heads = int(num_kv_heads);
  p.head_dim = int(head_dim);
  p.block_size = int(block_size);
  p.max_blocks = int(block_table.size(1));
  p.scale = float(scale);
  p.num_tokens = int(num_tokens);
  if (num_req == 0 || num_tokens == 0) return;
  const int64_t elem = key_cache.element_size();
  const bool vectorize =
      unit_stride(key_cache, 3) && unit_stride(value_cache, 3) &&
      can_vectorize(key_cache.data_ptr(), elem, head_dim, {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)}) &&
      can_vectorize(value_cache.data_ptr(), elem, head_dim,
                    {value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)});
  // Tensor cores where the device has them (launch.tensor_cores) and the operands allow 16-byte copies.
  const bool use_mma = launch.tensor_cores && query.scalar_type() != at::kFloat && attention_mma_head_dim(head_dim) &&
                       vectorize && can_vectorize(query.data_ptr(), elem, head_dim, {query.stride(0), query.stride(1)});
  p.num_splits = attention_num_splits(num_req * num_kv_heads, max_ctx_keys + max_query_keys, launch.num_sms,
                                      launch.forced_splits, use_mma ? kMmaTileKeys : kAttnTile);
  TORCH_CHECK(p.num_splits <= kMaxAttnSplits, "at most ", kMaxAttnSplits, " splits");
  if (use_mma && p.num_splits > 1) p.split_counters = arrival_counters(out, num_req * num_kv_heads);
  at::Tensor part_out, part_max, part_sum;
  if (p.num_splits > 1) {
    auto f32 = out.options().dtype(at::kFloat);
    part_out = at::empty({p.num_splits, num_tokens, num_heads, head_dim}, f32);
    part_max = at::empty({p.num_splits, num_tokens, num_heads}, f32);
    part_sum = at::empty({p.num_splits, num_tokens, num_heads}, f32);
    p.part_out = part_out.data_ptr<float>();
    p.part_max = part_max.data_ptr<float>();
    p.part_sum = part_sum.data_ptr<float>();
  }
  const int d_per_lane = int(div_up<int64_t>(head_dim, kWarpSize));
  // The most query rows one request can have, from shapes alone (no device read): its tokens are at most
  // the tree mask's width, or all tokens of the step.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_rows = std::min<int64_t>(max_query_keys, num_tokens) * group;
  const AttnShape shape = max_rows <= kAttnWarps * kAttnRowsPerWarpNarrow ? AttnShape::kNarrow
                          : max_rows <= kAttnWarps * kAttnRowsPerWarp    ? AttnShape::kRegular
                                                                         : AttnShape::kWide;
  if (use_mma) {
    const auto run = [&](auto tag) {
      using scalar_t = decltype(tag);
      if (head_dim == 64) return launch_attention_mma<scalar_t, 64>(p, int(num_req), max_rows, launch);
      return launch_attention_mma<scalar_t, 128>(p, int(num_req), max_rows, launch);
    };
    return query.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(c10::Half());
  }
  SV_DISPATCH_FLOAT_TYPES(query.scalar_type(), "block_sparse_tree_attention", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (!vectorize) return launch_attention<scalar_t, 8, 1>(p, int(num_req), shape, launch);
    switch (d_per_lane) {
      case 1: return launch_attention<scalar_t, 1, kVec>(p, int(num_req), shape, launch);
      case 2: return launch_attention<scalar_t, 2, kVec>(p, int(num_req), shape, launch);
      case 3: return launch_attention<scalar_t, 3, kVec>(p, int(num_req), shape, launch);
      case 4: return launch_attention<scalar_t, 4, kVec>(p, int(num_req), shape, launch);
      case 5: return launch_attention<scalar_t, 5, kVec>(p, int(num_req), shape, launch);
      case 6: return launch_attention<scalar_t, 6, kVec>(p, int(num_req), shape, launch);
      case 7: return launch_attention<scalar_t, 7, kVec>(p, int(num_req), shape, launch);
      default: return launch_attention<scalar_t, 8, kVec>(p, int(num_req), shape, launch);
    }
  });
}

}  // namespace kernels
}  // namespace sparsever
