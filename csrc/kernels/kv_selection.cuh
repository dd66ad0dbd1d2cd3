// KV block key summaries (Quest's per-channel key min/max per cache block) and the selection of the context
// blocks each request's verification attention reads. Semantics: reference.update_block_key_summaries and
// reference.select_kv_blocks.
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"
#include "last_cta.cuh"
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
// One launch. CTAs of kScoreBlocksPerCta middle blocks each write Quest upper bounds (one warp per block,
// summed over the GQA group's pooled queries) into a global scratch row per (request, KV head); the last of a
// row's CTAs to finish (last_cta.cuh) takes the block-wide top-k and writes the selection with the sink and
// local blocks around it. The selection is shared by all of the request's query tokens.

constexpr int kSelectThreads = 256;
// Many CTAs score (one scoring a long context alone would take milliseconds); one per row picks the top-k.
constexpr int kScoreBlocksPerCta = 64;

// How many context blocks request r has (capped at the block table's width).
SV_DEVICE int selection_context_blocks(const int* seq_lens, const int* query_lens, int r, int block_size,
                                       int max_blocks) {
  const int ctx_len = max_of(seq_lens[r] - query_lens[r], 0);
  return min_of(div_up(ctx_len, block_size), max_blocks);
}

struct SelectParams {
  const int* block_table;
  int64_t bt_stride;
  int max_blocks;
  const int* seq_lens;
  const int* query_lens;
  int block_size, top_k, num_sink, num_local;
  int num_heads, num_kv_heads, head_dim;
  const float* key_min;
  const float* key_max;
  float* scores;  // [R * Hkv, max_blocks] scratch
  int* selected;
  int64_t sel_stride_r, sel_stride_h;
  int slots;
  int* num_selected;
  int64_t ns_stride_r, ns_stride_h;
  int* counters;  // [R * Hkv] arrival counters (last_cta.cuh)
};

// scores[(r, h)][i] = sum_g sum_d max(q_g[d] * min[d], q_g[d] * max[d]) over the middle blocks i of
// chunk blockIdx.x, then (last CTA of the row) sinks, the top-k middle blocks by those scores, local blocks.
template <typename TQ>
__global__ void __launch_bounds__(kSelectThreads)
    select_kv_blocks_kernel(const TQ* __restrict__ query_pooled, int64_t q_stride_r, int64_t q_stride_h,
                            int64_t q_stride_d, const SelectParams p) {
  SV_DYNAMIC_SHARED(float, q);  // [group, head_dim] pooled queries of this KV head's query heads
  __shared__ BlockTopkScratch topk_scratch;
  __shared__ int last_flag;
  const int chunk = blockIdx.x;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int tid = threadIdx.x;
  const int n = selection_context_blocks(p.seq_lens, p.query_lens, r, p.block_size, p.max_blocks);
  const int middle = n - p.num_sink - p.num_local;
  const int budget = p.top_k + p.num_sink + p.num_local;
  const int first = chunk * kScoreBlocksPerCta;
  float* row_scores = p.scores + (int64_t(r) * p.num_kv_heads + h) * p.max_blocks;
  if (n > budget && first < middle) {  // else: a dense request, or past its middle blocks
    const int group = p.num_heads / p.num_kv_heads;
    for (int i = tid; i < group * p.head_dim; i += blockDim.x) {
      const int g = i / p.head_dim, d = i % p.head_dim;
      q[i] = to_float(query_pooled[r * q_stride_r + (h * group + g) * q_stride_h + d * q_stride_d]);
    }
    __syncthreads();
    const int lane = tid % kWarpSize, warp = tid / kWarpSize, num_warps = blockDim.x / kWarpSize;
    const int* table = p.block_table + r * p.bt_stride;
    const int last = min_of(middle, first + kScoreBlocksPerCta);
    for (int i = first + warp; i < last; i += num_warps) {
      const int64_t phys = table[p.num_sink + i];
      const float* lo = p.key_min + (phys * p.num_kv_heads + h) * p.head_dim;
      const float* hi = p.key_max + (phys * p.num_kv_heads + h) * p.head_dim;
      float s = 0.0f;
      for (int d = lane; d < p.head_dim; d += kWarpSize) {
        const float a = lo[d], b = hi[d];
        for (int g = 0; g < group; ++g) {
          const float qv = q[g * p.head_dim + d];
          s += fmaxf(qv * a, qv * b);
        }
      }
      s = warp_reduce_sum(s);
      if (lane == 0) row_scores[i] = s;
    }
  }
  if (!arrive_last(p.counters + r * p.num_kv_heads + h, gridDim.x, &last_flag)) return;

  int* sel = p.selected + r * p.sel_stride_r + h * p.sel_stride_h;
  if (n <= budget) {  // short context: every context block, i.e. dense
    for (int i = tid; i < p.slots; i += blockDim.x) sel[i] = i < n ? i : -1;
    if (tid == 0) p.num_selected[r * p.ns_stride_r + h * p.ns_stride_h] = min_of(n, p.slots);
    return;
  }
  // Layout of the row: sinks [0, num_sink), top-k middle blocks (ascending), local blocks, then -1.
  int* middle_out = sel + p.num_sink;
  if (budget <= p.slots) {
    block_topk_ascending([&](int i) { return __ldcg(row_scores + i); }, middle, p.top_k, middle_out, topk_scratch);
  }
  __syncthreads();
  for (int i = tid; i < p.slots; i += blockDim.x) {
    if (i < p.num_sink) {
      sel[i] = i;
    } else if (i < p.num_sink + p.top_k) {
      if (budget <= p.slots) sel[i] += p.num_sink;  // top-k wrote indices relative to the middle range
    } else if (i < budget) {
      sel[i] = n - p.num_local + (i - p.num_sink - p.top_k);
    } else {
      sel[i] = -1;
    }
  }
  // The host checks slots >= budget; a smaller row would have been rejected there.
  if (tid == 0) p.num_selected[r * p.ns_stride_r + h * p.ns_stride_h] = budget <= p.slots ? budget : 0;
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
  SelectParams p{};
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.max_blocks = int(max_blocks);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_lens = query_lens.data_ptr<int>();
  p.block_size = int(block_size);
  p.top_k = int(top_k);
  p.num_sink = int(num_sink);
  p.num_local = int(num_local);
  p.num_heads = int(num_heads);
  p.num_kv_heads = int(num_kv_heads);
  p.head_dim = int(head_dim);
  p.key_min = key_min.data_ptr<float>();
  p.key_max = key_max.data_ptr<float>();
  p.scores = scores.data_ptr<float>();
  p.selected = selected.data_ptr<int>();
  p.sel_stride_r = selected.stride(0);
  p.sel_stride_h = selected.stride(1);
  p.slots = int(slots);
  p.num_selected = num_selected.data_ptr<int>();
  p.ns_stride_r = num_selected.stride(0);
  p.ns_stride_h = num_selected.stride(1);
  p.counters = arrival_counters(selected, num_req * num_kv_heads);
  const size_t smem = size_t(num_heads / num_kv_heads) * head_dim * sizeof(float);
  const unsigned chunks = unsigned(std::max<int64_t>(1, div_up<int64_t>(max_blocks, kScoreBlocksPerCta)));
  SV_DISPATCH_FLOAT_TYPES(query_pooled.scalar_type(), "select_kv_blocks", [&] {
    launch(dim3(chunks, unsigned(num_kv_heads), unsigned(num_req)), dim3(kSelectThreads), smem,
           select_kv_blocks_kernel<scalar_t>, query_pooled.data_ptr<scalar_t>(), query_pooled.stride(0),
           query_pooled.stride(1), query_pooled.stride(2), p);
  });
}

}  // namespace kernels
}  // namespace sparsever
