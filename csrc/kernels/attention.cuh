// Block-sparse tree attention over the paged KV cache (semantics: reference.block_sparse_tree_attention).
//
// One CTA per (split, KV head, request). Its keys are, in order, the request's selected context blocks
// (positions < ctx_len inside them) followed by the request's own query tokens (positions ctx_len + j,
// admitted per query row by the tree mask, or causally). Every key tile is loaded ONCE per CTA and used by
// all query rows of the request that share the KV head: rows are (query token, query head of the GQA
// group) pairs, so one KV read serves every draft token and every head of the group - the point of a
// selection shared by the request. Online softmax in fp32; with split-K, each split writes unnormalised
// partials (acc, running max, running sum) and a combine kernel merges them. KV strides are arguments, so
// vLLM-CPU's transposed K and GPU layouts both work (16-byte vector loads when head_dim is contiguous).
#pragma once

#include "compat.cuh"
#include "host_utils.cuh"
#include "last_cta.cuh"

namespace sparsever {
namespace kernels {

// A CTA has 4 warps, or 8 when a request may have more than 32 query rows (tokens x GQA group): every row
// pass re-reads the request's keys, so 64 rows in one pass halve the KV reads of 16-token verify steps.
constexpr int kAttnWarps = 4;
constexpr int kAttnWarpsWide = 8;
constexpr int kAttnRowsPerWarp = 8;  // query rows per warp (registers: rows * kDPerLane accumulators)
constexpr int kAttnRowsPerWarpNarrow = 4;  // up to 16 rows: 4 per warp, so every warp computes
constexpr int kAttnTile = kWarpSize;                           // keys per tile: one key per lane for QK^T
constexpr int kKeyInvalid = -2;                                // tile slot past the end / outside the context
constexpr int kKeyContext = -1;                                // context key: every row may attend
constexpr int kMaxAttnSplits = 64;  // the split heuristic's cap; a merging warp keeps one weight per split

struct AttentionParams {
  void* out;
  int64_t out_stride_t, out_stride_h;
  const void* query;
  int64_t q_stride_t, q_stride_h;
  const void* key_cache;
  const void* value_cache;
  int64_t k_stride_b, k_stride_h, k_stride_t, k_stride_d;
  int64_t v_stride_b, v_stride_h, v_stride_t, v_stride_d;
  const int* block_table;
  int64_t bt_stride;
  const int* seq_lens;
  const int* query_start_loc;
  const int* selected;  // nullptr = dense
  int64_t sel_stride_r, sel_stride_h;
  const int* num_selected;
  int64_t ns_stride_r, ns_stride_h;
  const uint8_t* tree_mask;  // nullptr = causal chain
  int64_t mask_stride;
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  int num_splits;
  float* part_out;  // [num_splits, T, Hq, D]   (num_splits > 1 only)
  float* part_max;  // [num_splits, T, Hq]
  float* part_sum;  // [num_splits, T, Hq]
  int num_tokens;
  int* split_counters;  // [R * Hkv] arrival counters: the last split merges (tensor-core kernel), or nullptr
};

// One request's keys for one KV head, in the order both attention kernels read them: its (selected) context
// blocks (positions < ctx_len inside them; padding and unselected slots invalid), then its own query tokens.
struct RequestKeys {
  int t0, q_len, ctx_len, group, num_rows, ctx_keys, total_keys;
  const int* sel;  // selected logical blocks, or nullptr (dense)

  SV_DEVICE RequestKeys(const AttentionParams& p, int r, int h) {
    t0 = p.query_start_loc[r];
    q_len = p.query_start_loc[r + 1] - t0;
    ctx_len = max_of(p.seq_lens[r] - q_len, 0);
    group = p.num_heads / p.num_kv_heads;
    num_rows = q_len * group;
    sel = nullptr;
    int num_ctx_blocks = div_up(ctx_len, p.block_size);
    if (p.selected != nullptr) {
      sel = p.selected + r * p.sel_stride_r + h * p.sel_stride_h;
      num_ctx_blocks = p.num_selected[r * p.ns_stride_r + h * p.ns_stride_h];
    }
    ctx_keys = num_ctx_blocks * p.block_size;  // includes padding past ctx_len (masked)
    total_keys = ctx_keys + q_len;
  }

  // Key `key` of the list: kKeyContext, the index of a query token, or kKeyInvalid; `pos` its position.
  SV_DEVICE int code(const AttentionParams& p, int key, int& pos) const {
    pos = 0;
    if (key < ctx_keys) {
      const int logical = sel != nullptr ? sel[key / p.block_size] : key / p.block_size;
      pos = logical * p.block_size + key % p.block_size;
      return logical >= 0 && pos < ctx_len ? kKeyContext : kKeyInvalid;
    }
    if (key < total_keys) {
      pos = ctx_len + (key - ctx_keys);
      return key - ctx_keys;
    }
    return kKeyInvalid;
  }

  // Whether query row `row` ((token, head of the group) pairs, token-major) may attend to a key of `code`:
  // context keys always, query tokens by the tree mask or causally.
  SV_DEVICE bool allows(const AttentionParams& p, int row, int code) const {
    if (row >= num_rows || code == kKeyInvalid) return false;
    if (code == kKeyContext) return true;
    const int tok = row / group;
    return p.tree_mask != nullptr ? p.tree_mask[(t0 + tok) * p.mask_stride + code] != 0 : code <= tok;
  }
};

// Shared memory (floats): q[rows][D] | k[kAttnTile][D + 1] | v[kAttnTile][D] | p[rows][kAttnTile], then
// per-key ints: code[kAttnTile] and int64 offsets k_off/v_off[kAttnTile]; rows = warps * rows per warp.
inline size_t attention_smem_bytes(int head_dim, int warps, int rows_per_warp) {
  const size_t rows = size_t(warps) * rows_per_warp;
  size_t floats = rows * head_dim + size_t(kAttnTile) * (head_dim + 1) + size_t(kAttnTile) * head_dim +
                  rows * kAttnTile;
  floats = (floats + 1) & ~size_t(1);  // 8-byte alignment for the offsets
  return floats * sizeof(float) + kAttnTile * (sizeof(int) + 2 * sizeof(int64_t));
}

// Min. blocks 1: without it ptxas held some sm_80 variants near 72 registers and spilled; shared memory
// limits residency before registers do.
template <typename T, int kDPerLane, int kVec, int kWarps, int kRowsPerWarp>
__global__ void __launch_bounds__(kWarps * kWarpSize, 1) block_sparse_tree_attention_kernel(const AttentionParams p) {
  constexpr int kAttnThreads = kWarps * kWarpSize;
  constexpr int kAttnRows = kWarps * kRowsPerWarp;  // query rows per CTA pass
  const int split = blockIdx.x;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int D = p.head_dim;

  const RequestKeys keys(p, r, h);
  if (keys.q_len <= 0) return;
  const int t0 = keys.t0, group = keys.group, num_rows = keys.num_rows;
  const int num_tiles = div_up(keys.total_keys, kAttnTile);
  const int tiles_per_split = div_up(num_tiles, p.num_splits);
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min_of(num_tiles, tile_begin + tiles_per_split);

  SV_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                                // [kAttnRows][D]
  float* k_s = q_s + kAttnRows * D;                 // [kAttnTile][D + 1]  (padded: conflict-free per-key reads)
  float* v_s = k_s + kAttnTile * (D + 1);           // [kAttnTile][D]
  float* p_s = v_s + kAttnTile * D;                 // [kAttnRows][kAttnTile]
  size_t float_count = size_t(kAttnRows) * D + size_t(kAttnTile) * (D + 1) + size_t(kAttnTile) * D +
                       size_t(kAttnRows) * kAttnTile;
  float_count = (float_count + 1) & ~size_t(1);
  int64_t* k_off = reinterpret_cast<int64_t*>(smem + float_count);
  int64_t* v_off = k_off + kAttnTile;
  int* code = reinterpret_cast<int*>(v_off + kAttnTile);

  const T* __restrict__ query = static_cast<const T*>(p.query);
  const T* __restrict__ kc = static_cast<const T*>(p.key_cache);
  const T* __restrict__ vc = static_cast<const T*>(p.value_cache);
  const int* table = p.block_table + r * p.bt_stride;

  for (int row0 = 0; row0 < num_rows; row0 += kAttnRows) {
    __syncthreads();  // q_s of the previous pass is no longer read
    for (int i = tid; i < kAttnRows * D; i += kAttnThreads) {
      const int row = row0 + i / D, d = i % D;
      float v = 0.0f;
      if (row < num_rows) {
        const int tok = t0 + row / group, head = h * group + row % group;
        v = to_float(query[tok * p.q_stride_t + head * p.q_stride_h + d]) * p.scale;
      }
      q_s[i] = v;
    }
    float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], acc[kRowsPerWarp][kDPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.0f;
#pragma unroll
      for (int c = 0; c < kDPerLane; ++c) acc[i][c] = 0.0f;
    }
    const int warp_row0 = row0 + warp * kRowsPerWarp;
    const bool warp_active = warp_row0 < num_rows;  // warp-uniform

    for (int tile = tile_begin; tile < tile_end; ++tile) {
      __syncthreads();  // previous tile fully consumed
      if (tid < kAttnTile) {
        int pos;
        const int c = keys.code(p, tile * kAttnTile + tid, pos);
        int64_t ko = 0, vo = 0;
        if (c != kKeyInvalid) {
          const int64_t phys = table[pos / p.block_size];
          const int off = pos % p.block_size;
          ko = phys * p.k_stride_b + h * p.k_stride_h + off * p.k_stride_t;
          vo = phys * p.v_stride_b + h * p.v_stride_h + off * p.v_stride_t;
        }
        code[tid] = c;
        k_off[tid] = ko;
        v_off[tid] = vo;
      }
      __syncthreads();
      // Load the K and V tile (fp32 in shared memory); invalid keys are zeroed (0 * garbage could be NaN).
      const int vecs_per_key = D / kVec;
      for (int i = tid; i < kAttnTile * vecs_per_key; i += kAttnThreads) {
        const int j = i / vecs_per_key, d0 = (i % vecs_per_key) * kVec;
        float kv[kVec], vv[kVec];
        if (code[j] != kKeyInvalid) {
          if constexpr (kVec > 1) {
            const auto kraw = *reinterpret_cast<const AlignedVec<T, kVec>*>(kc + k_off[j] + d0);
            const auto vraw = *reinterpret_cast<const AlignedVec<T, kVec>*>(vc + v_off[j] + d0);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              kv[e] = to_float(kraw.val[e]);
              vv[e] = to_float(vraw.val[e]);
            }
          } else {
            kv[0] = to_float(kc[k_off[j] + d0 * p.k_stride_d]);
            vv[0] = to_float(vc[v_off[j] + d0 * p.v_stride_d]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) kv[e] = vv[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          k_s[j * (D + 1) + d0 + e] = kv[e];
          v_s[j * D + d0 + e] = vv[e];
        }
      }
      __syncthreads();
      if (warp_active) {
        // Logits: lane j scores key j of the tile against each of the warp's rows.
        float s[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) s[i] = 0.0f;
        const float* k_row = k_s + lane * (D + 1);
        const float* q_rows = q_s + (warp * kRowsPerWarp) * D;
        for (int d = 0; d < D; ++d) {
          const float kd = k_row[d];
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i) s[i] = fmaf(q_rows[i * D + d], kd, s[i]);
        }
        const int key_code = code[lane];
        float* p_rows = p_s + (warp * kRowsPerWarp) * kAttnTile;
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const bool allowed = keys.allows(p, warp_row0 + i, key_code);
          const float logit = allowed ? s[i] : -INFINITY;
          const float new_max = fmaxf(row_max[i], warp_reduce_max(logit));
          // -inf guards: a row with nothing allowed so far keeps max -inf and contributes zeros.
          const float prob = allowed ? __expf(logit - new_max) : 0.0f;
          const float alpha = row_max[i] == -INFINITY ? 0.0f : __expf(row_max[i] - new_max);
          row_sum[i] = row_sum[i] * alpha + warp_reduce_sum(prob);
          row_max[i] = new_max;
#pragma unroll
          for (int c = 0; c < kDPerLane; ++c) acc[i][c] *= alpha;
          p_rows[i * kAttnTile + lane] = prob;
        }
        __syncwarp();
        // P.V: lane owns head dims lane, lane + 32, ...
        for (int j = 0; j < kAttnTile; ++j) {
          float vj[kDPerLane];
#pragma unroll
          for (int c = 0; c < kDPerLane; ++c) {
            const int d = lane + c * kWarpSize;
            vj[c] = d < D ? v_s[j * D + d] : 0.0f;
          }
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i) {
            const float pij = p_rows[i * kAttnTile + j];
#pragma unroll
            for (int c = 0; c < kDPerLane; ++c) acc[i][c] = fmaf(pij, vj[c], acc[i][c]);
          }
        }
      }
    }

    if (warp_active) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp_row0 + i;
        if (row >= num_rows) continue;
        const int tok = t0 + row / group, head = h * group + row % group;
        if (p.num_splits == 1) {
          T* o = static_cast<T*>(p.out) + tok * p.out_stride_t + head * p.out_stride_h;
          const float inv = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f;  // no allowed key -> zeros
#pragma unroll
          for (int c = 0; c < kDPerLane; ++c) {
            const int d = lane + c * kWarpSize;
            if (d < D) o[d] = from_float<T>(acc[i][c] * inv);
          }
        } else {
          const int64_t idx = (int64_t(split) * p.num_tokens + tok) * p.num_heads + head;
          float* o = p.part_out + idx * D;
#pragma unroll
          for (int c = 0; c < kDPerLane; ++c) {
            const int d = lane + c * kWarpSize;
            if (d < D) o[d] = acc[i][c];
          }
          if (lane == 0) {
            p.part_max[idx] = row_max[i];
            p.part_sum[idx] = row_sum[i];
          }
        }
      }
    }
  }
}

// Merge the splits of one (token, query head) with one warp: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// Partials are read with __ldcg (L2, not a possibly stale L1: the tensor-core kernel merges in the last CTA of
// the launch that wrote them); `weights` holds num_splits floats of the warp's shared memory.
template <typename T>
SV_DEVICE void merge_attention_splits_warp(const AttentionParams& p, int tok, int head, float* weights) {
  const int lane = threadIdx.x % kWarpSize;
  auto index = [&](int s) { return (int64_t(s) * p.num_tokens + tok) * p.num_heads + head; };
  float m = -INFINITY;
  for (int s = lane; s < p.num_splits; s += kWarpSize) m = fmaxf(m, __ldcg(p.part_max + index(s)));
  m = warp_reduce_max(m);
  float total = 0.0f;
  for (int s = lane; s < p.num_splits; s += kWarpSize) {
    const float ms = __ldcg(p.part_max + index(s));
    const float w = ms == -INFINITY ? 0.0f : __expf(ms - m);
    total += __ldcg(p.part_sum + index(s)) * w;
    weights[s] = w;
  }
  total = warp_reduce_sum(total);
  __syncwarp();
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no allowed key -> zeros
  T* o = static_cast<T*>(p.out) + tok * p.out_stride_t + head * p.out_stride_h;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    float v = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) v += weights[s] * __ldcg(p.part_out + index(s) * p.head_dim + d);
    o[d] = from_float<T>(v * inv);
  }
  __syncwarp();  // the weights are rewritten for the next row
}

// Merge the splits of a request's tokens for one query head (the CUDA-core kernel's second launch): one CTA
// per (query head, request), a warp per token.
constexpr int kCombineWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kCombineWarps * kWarpSize) combine_attention_splits_kernel(const AttentionParams p) {
  __shared__ float weights[kCombineWarps][kMaxAttnSplits];
  const int head = blockIdx.x, r = blockIdx.y, warp = threadIdx.x / kWarpSize;
  for (int tok = p.query_start_loc[r] + warp; tok < p.query_start_loc[r + 1]; tok += kCombineWarps) {
    merge_attention_splits_warp<T>(p, tok, head, weights[warp]);
  }
}

}  // namespace kernels
}  // namespace sparsever
