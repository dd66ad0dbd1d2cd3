// KV block key summaries (Quest's per-channel key min/max per cache block) and the selection of the context
// blocks each request's verification attention reads. Semantics: reference.update_block_key_summaries and
// reference.select_kv_blocks.
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"
#include "topk.cuh"

namespace sparsever {
namespace kernels {

// ---- update_block_key_summaries ----------------------------------------------------------------------
// Exact recompute of every touched block over offsets 0..last, where last is the largest offset written
// to the block in this call (its fill level). Pass 1 finds each block's fill level; pass 2 runs one CTA
// per slot and lets only the slot holding the block's last offset recompute it (reads bs*Hkv*D keys at
// most once per touched block).

template <typename SlotT>
__global__ void mark_block_fill_kernel(const SlotT* __restrict__ slot_mapping, int num_slots, int block_size,
                                       int64_t num_blocks, int* __restrict__ fill) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_slots) return;
  const int64_t slot = int64_t(slot_mapping[i]);
  if (slot < 0) return;  // vLLM pads with -1
  const int64_t block = slot / block_size;
  if (block < num_blocks) atomicMax(&fill[block], int(slot % block_size) + 1);
}

template <typename T, typename SlotT>
__global__ void recompute_key_summaries_kernel(const T* __restrict__ key_cache, int64_t stride_block,
                                               int64_t stride_head, int64_t stride_token, int64_t stride_dim,
                                               const SlotT* __restrict__ slot_mapping, int block_size,
                                               int64_t num_blocks, const int* __restrict__ fill,
                                               int num_kv_heads, int head_dim, float* __restrict__ key_min,
                                               float* __restrict__ key_max) {
  const int64_t slot = int64_t(slot_mapping[blockIdx.x]);
  if (slot < 0) return;
  const int64_t block = slot / block_size;
  const int offset = int(slot % block_size);
  if (block >= num_blocks || fill[block] != offset + 1) return;  // another slot owns this block
  const int channels = num_kv_heads * head_dim;
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    const int h = c / head_dim;
    const int d = c % head_dim;
    const T* p = key_cache + block * stride_block + h * stride_head + d * stride_dim;
    float lo = INFINITY, hi = -INFINITY;
    for (int o = 0; o <= offset; ++o) {
      const float v = to_float(p[o * stride_token]);
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    key_min[block * channels + c] = lo;
    key_max[block * channels + c] = hi;
  }
}

template <class Launcher>
void update_block_key_summaries_impl(const at::Tensor& key_cache, const at::Tensor& slot_mapping,
                                     int64_t block_size, at::Tensor& key_min, at::Tensor& key_max,
                                     const Launcher& launch) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(key_cache.size(2) == block_size, "key_cache block size ", key_cache.size(2), " != ", block_size);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1), head_dim = key_cache.size(3);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&key_min, &key_max}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "key_min/key_max must be contiguous fp32");
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_blocks && t->size(1) == num_kv_heads && t->size(2) == head_dim,
                "key_min/key_max must be [num_blocks, num_kv_heads, head_dim]");
    check_same_device(key_cache, *t, "key_min/key_max");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous(), "slot_mapping must be 1-D contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int32 or int64");
  check_same_device(key_cache, slot_mapping, "slot_mapping");
  const int64_t num_slots = slot_mapping.numel();
  if (num_slots == 0 || num_blocks == 0) return;
  at::Tensor fill = at::zeros({num_blocks}, key_cache.options().dtype(at::kInt));
  auto run = [&](auto slot_tag) {
    using SlotT = decltype(slot_tag);
    const SlotT* slots = slot_mapping.data_ptr<SlotT>();
    launch(dim3(unsigned(div_up<int64_t>(num_slots, 256))), dim3(256), 0, mark_block_fill_kernel<SlotT>, slots,
           int(num_slots), int(block_size), num_blocks, fill.data_ptr<int>());
    SV_DISPATCH_FLOAT_TYPES(key_cache.scalar_type(), "update_block_key_summaries", [&] {
      launch(dim3(unsigned(num_slots)), dim3(128), 0, recompute_key_summaries_kernel<scalar_t, SlotT>,
             key_cache.data_ptr<scalar_t>(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
             key_cache.stride(3), slots, int(block_size), num_blocks, fill.data_ptr<int>(), int(num_kv_heads),
             int(head_dim), key_min.data_ptr<float>(), key_max.data_ptr<float>());
    });
  };
  if (slot_mapping.scalar_type() == at::kInt) {
    run(int32_t{});
  } else {
    run(int64_t{});
  }
}

// ---- select_kv_blocks -----------------------------------------------------------------------------
// One CTA per (KV head, request): Quest upper bounds of the middle blocks (one warp per block, summed over
// the GQA group's pooled queries) into a global scratch row, then the block-wide top-k; sink and local
// blocks are added around it. The selection is shared by all of the request's query tokens.

constexpr int kSelectThreads = 256;
// Quest scores are computed by many CTAs (kScoreBlocksPerCta middle blocks each), then one CTA per
// (KV head, request) picks the top-k: one CTA scoring a long context alone would take milliseconds.
constexpr int kScoreBlocksPerCta = 64;

// How many context blocks request r has (capped at the block table's width).
SV_DEVICE int selection_context_blocks(const int* seq_lens, const int* query_lens, int r, int block_size,
                                       int max_blocks) {
  const int ctx_len = max_of(seq_lens[r] - query_lens[r], 0);
  return min_of(div_up(ctx_len, block_size), max_blocks);
}

// scores[(r, h)][i] = sum_g sum_d max(q_g[d] * min[d], q_g[d] * max[d]) over the middle blocks i of
// chunk blockIdx.x (one warp per block); requests whose budget keeps every block are skipped.
template <typename TQ>
__global__ void __launch_bounds__(kSelectThreads)
    quest_block_scores_kernel(const TQ* __restrict__ query_pooled, int64_t q_stride_r, int64_t q_stride_h,
                              int64_t q_stride_d, const float* __restrict__ key_min,
                              const float* __restrict__ key_max, const int* __restrict__ block_table,
                              int64_t bt_stride, int max_blocks, const int* __restrict__ seq_lens,
                              const int* __restrict__ query_lens, int block_size, int budget, int num_sink,
                              int num_local, int num_heads, int num_kv_heads, int head_dim,
                              float* __restrict__ scores) {
  SV_DYNAMIC_SHARED(float, q);  // [group, head_dim] pooled queries of this KV head's query heads
  const int chunk = blockIdx.x;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int tid = threadIdx.x;
  const int n = selection_context_blocks(seq_lens, query_lens, r, block_size, max_blocks);
  const int middle = n - num_sink - num_local;
  const int first = chunk * kScoreBlocksPerCta;
  if (n <= budget || first >= middle) return;  // dense request, or past its middle blocks
  const int group = num_heads / num_kv_heads;
  for (int i = tid; i < group * head_dim; i += blockDim.x) {
    const int g = i / head_dim, d = i % head_dim;
    q[i] = to_float(query_pooled[r * q_stride_r + (h * group + g) * q_stride_h + d * q_stride_d]);
  }
  __syncthreads();
  float* row_scores = scores + (int64_t(r) * num_kv_heads + h) * max_blocks;
  const int lane = tid % kWarpSize, warp = tid / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int* table = block_table + r * bt_stride;
  const int last = min_of(middle, first + kScoreBlocksPerCta);
  for (int i = first + warp; i < last; i += num_warps) {
    const int64_t phys = table[num_sink + i];
    const float* lo = key_min + (phys * num_kv_heads + h) * head_dim;
    const float* hi = key_max + (phys * num_kv_heads + h) * head_dim;
    float s = 0.0f;
    for (int d = lane; d < head_dim; d += kWarpSize) {
      const float a = lo[d], b = hi[d];
      for (int g = 0; g < group; ++g) {
        const float qv = q[g * head_dim + d];
        s += fmaxf(qv * a, qv * b);
      }
    }
    s = warp_reduce_sum(s);
    if (lane == 0) row_scores[i] = s;
  }
}

// One CTA per (KV head, request): sinks, the top-k middle blocks by the scores above, local blocks.
// (A template only so that the header may be included by several translation units.)
template <int kThreads = kSelectThreads>
__global__ void __launch_bounds__(kThreads)
    select_kv_blocks_kernel(const int* __restrict__ seq_lens, const int* __restrict__ query_lens, int max_blocks,
                            int block_size, int top_k, int num_sink, int num_local, int num_kv_heads,
                            const float* __restrict__ scores, int* __restrict__ selected, int64_t sel_stride_r,
                            int64_t sel_stride_h, int slots, int* __restrict__ num_selected,
                            int64_t ns_stride_r, int64_t ns_stride_h) {
  __shared__ BlockTopkScratch topk_scratch;
  const int h = blockIdx.x;
  const int r = blockIdx.y;
  const int tid = threadIdx.x;
  int* sel = selected + r * sel_stride_r + h * sel_stride_h;
  const int n = selection_context_blocks(seq_lens, query_lens, r, block_size, max_blocks);
  const int budget = top_k + num_sink + num_local;
  if (n <= budget) {  // short context: every context block, i.e. dense
    for (int i = tid; i < slots; i += blockDim.x) sel[i] = i < n ? i : -1;
    if (tid == 0) num_selected[r * ns_stride_r + h * ns_stride_h] = min_of(n, slots);
    return;
  }
  const int middle = n - num_sink - num_local;
  const float* row_scores = scores + (int64_t(r) * num_kv_heads + h) * max_blocks;
  // Layout of the row: sinks [0, num_sink), top-k middle blocks (ascending), local blocks, then -1.
  int* middle_out = sel + num_sink;
  if (budget <= slots) {
    block_topk_ascending([&](int i) { return row_scores[i]; }, middle, top_k, middle_out, topk_scratch);
  }
  __syncthreads();
  for (int i = tid; i < slots; i += blockDim.x) {
    if (i < num_sink) {
      sel[i] = i;
    } else if (i < num_sink + top_k) {
      if (budget <= slots) sel[i] += num_sink;  // top-k wrote indices relative to the middle range
    } else if (i < budget) {
      sel[i] = n - num_local + (i - num_sink - top_k);
    } else {
      sel[i] = -1;
    }
  }
  // The host checks slots >= budget; a smaller row would have been rejected there.
  if (tid == 0) num_selected[r * ns_stride_r + h * ns_stride_h] = budget <= slots ? budget : 0;
}

template <class Launcher>
void select_kv_blocks_impl(const at::Tensor& query_pooled, const at::Tensor& key_min, const at::Tensor& key_max,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                           int64_t block_size, int64_t top_k, int64_t num_sink, int64_t num_local,
                           at::Tensor& selected, at::Tensor& num_selected, const Launcher& launch) {
  TORCH_CHECK(query_pooled.dim() == 3, "query_pooled must be [R, Hq, D]");
  TORCH_CHECK(key_min.dim() == 3 && key_min.is_contiguous() && key_max.is_contiguous() &&
                  key_min.sizes() == key_max.sizes() && key_min.scalar_type() == at::kFloat &&
                  key_max.scalar_type() == at::kFloat,
              "key_min/key_max must be contiguous fp32 [num_blocks, num_kv_heads, head_dim]");
  const int64_t num_req = query_pooled.size(0), num_heads = query_pooled.size(1), head_dim = query_pooled.size(2);
  const int64_t num_kv_heads = key_min.size(1);
  TORCH_CHECK(key_min.size(2) == head_dim, "key_min head_dim ", key_min.size(2), " != query head_dim ", head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  check_int32(block_table, "block_table");
  check_int32(seq_lens, "seq_lens");
  check_int32(query_lens, "query_lens");
  check_int32(selected, "selected");
  check_int32(num_selected, "num_selected");
  TORCH_CHECK(block_table.dim() == 2 && unit_stride(block_table, 1) && block_table.size(0) >= num_req,
              "block_table must be [R, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.is_contiguous() && query_lens.is_contiguous() && seq_lens.numel() >= num_req &&
                  query_lens.numel() >= num_req,
              "seq_lens/query_lens must be contiguous [R]");
  TORCH_CHECK(selected.dim() == 3 && selected.size(0) == num_req && selected.size(1) == num_kv_heads &&
                  unit_stride(selected, 2),
              "selected must be [R, Hkv, S] with contiguous rows");
  TORCH_CHECK(num_selected.dim() == 2 && num_selected.size(0) == num_req && num_selected.size(1) == num_kv_heads,
              "num_selected must be [R, Hkv]");
  TORCH_CHECK(top_k >= 0 && num_sink >= 0 && num_local >= 0, "top_k/num_sink/num_local must be >= 0");
  const int64_t slots = selected.size(2);
  const int64_t max_blocks = block_table.size(1);
  // Without reading seq_lens on the host (no device sync) every request may need the full budget.
  TORCH_CHECK(slots >= std::min(max_blocks, top_k + num_sink + num_local), "selected has ", slots,
              " slots per head; needs min(max_blocks, top_k + num_sink + num_local) = ",
              std::min(max_blocks, top_k + num_sink + num_local));
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&key_min, &key_max, &block_table, &seq_lens, &query_lens, &selected, &num_selected})
    check_same_device(query_pooled, *t, "select_kv_blocks argument");
  if (num_req == 0 || num_kv_heads == 0) return;
  at::Tensor scores = at::empty({num_req * num_kv_heads, std::max<int64_t>(max_blocks, 1)},
                                query_pooled.options().dtype(at::kFloat));
  const size_t smem = size_t(num_heads / num_kv_heads) * head_dim * sizeof(float);
  const int budget = int(top_k + num_sink + num_local);
  const unsigned chunks = unsigned(std::max<int64_t>(1, div_up<int64_t>(max_blocks, kScoreBlocksPerCta)));
  SV_DISPATCH_FLOAT_TYPES(query_pooled.scalar_type(), "select_kv_blocks", [&] {
    launch(dim3(chunks, unsigned(num_kv_heads), unsigned(num_req)), dim3(kSelectThreads), smem,
           quest_block_scores_kernel<scalar_t>, query_pooled.data_ptr<scalar_t>(), query_pooled.stride(0),
           query_pooled.stride(1), query_pooled.stride(2), key_min.data_ptr<float>(), key_max.data_ptr<float>(),
           block_table.data_ptr<int>(), block_table.stride(0), int(max_blocks), seq_lens.data_ptr<int>(),
           query_lens.data_ptr<int>(), int(block_size), budget, int(num_sink), int(num_local), int(num_heads),
           int(num_kv_heads), int(head_dim), scores.data_ptr<float>());
  });
  launch(dim3(unsigned(num_kv_heads), unsigned(num_req)), dim3(kSelectThreads), 0, select_kv_blocks_kernel<>,
         seq_lens.data_ptr<int>(), query_lens.data_ptr<int>(), int(max_blocks), int(block_size), int(top_k),
         int(num_sink), int(num_local), int(num_kv_heads), scores.data_ptr<float>(), selected.data_ptr<int>(),
         selected.stride(0), selected.stride(1), int(slots), num_selected.data_ptr<int>(), num_selected.stride(0),
         num_selected.stride(1));
}

}  // namespace kernels
}  // namespace sparsever
