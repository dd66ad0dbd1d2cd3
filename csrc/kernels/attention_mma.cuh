// Verify attention on tensor cores (sm_80+, bf16/fp16, head_dim 64 or 128, 16-byte-aligned rows): the
// same op and semantics as block_sparse_tree_attention_kernel (attention.cuh), built like FlashDecoding /
// FlashInfer's split-KV decode with tensor cores:
//   * one CTA per (split, KV head, request); its query rows are every (draft token, query head of the GQA
//     group) pair of the request, so each K/V tile is read once for all of them;
//   * 64-key tiles of K and V stream into shared memory with 16-byte cp.async copies, double-buffered (the
//     next tile's copies fly while the current one is computed), read straight from the paged cache
//     through its strides; keys are the request's (selected) context blocks, then its own query tokens;
//   * QK^T and PV are mma.sync m16n8k16 with fp32 accumulators, operands fetched by ldmatrix; the softmax
//     probabilities go from the QK^T accumulators to PV's A operand in registers (FlashAttention-2);
//   * 4 warps: with up to 16 query rows each warp takes a quarter of every tile (its own online softmax),
//     with 17-32 rows two warps per 16 rows share a tile, with more each warp has 16 rows of the tile; the
//     warps' partial softmax states merge in shared memory, the splits' in the last split's CTA to finish
//     (last_cta.cuh): one launch, so selection + attention are two.
#pragma once

#include "attention.cuh"
#include "mma.cuh"

namespace sparsever {
namespace kernels {

constexpr int kMmaWarps = 4;
constexpr int kMmaTileKeys = 64;  // keys per pipeline stage
constexpr int kMmaStages = 2;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Which head dims the tensor-core kernel is built for (others take the CUDA-core kernel).
inline bool attention_mma_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

template <int D, int kRowWarps>
struct AttentionMmaLayout {
  static constexpr int kRows = 16 * kRowWarps;                // query rows per CTA pass
  static constexpr int kStride = D + 8;                       // smem row pitch (+16 B: conflict-free ldmatrix)
  static constexpr size_t kQBytes = size_t(kRows) * kStride * 2;
  static constexpr size_t kTileBytes = size_t(kMmaTileKeys) * kStride * 2;  // one K or V stage
  static constexpr size_t kKvBytes = 2 * kMmaStages * kTileBytes;
  // After the key loop the K/V stages hold each warp's partial state: O [16][D], max [16], sum [16].
  static constexpr size_t kMergeBytes = size_t(kMmaWarps) * 16 * (D + 2) * sizeof(float);
  static_assert(kMergeBytes <= kKvBytes, "the warps' partial states must fit in the K/V stages");
  static_assert(size_t(kMmaWarps) * kMaxAttnSplits * sizeof(float) <= kKvBytes, "split merge weights");
  static constexpr size_t kCodeBytes = size_t(kMmaStages) * kMmaTileKeys * sizeof(int);
  static constexpr size_t kBytes = kQBytes + kKvBytes + kCodeBytes;
};

// Min. blocks 1: without it ptxas holds some variants under ~168 registers and spills; two CTAs per SM
// still fit in registers and shared memory.
template <typename T, int D, int kRowWarps>
__global__ void __launch_bounds__(kMmaWarps * kWarpSize, 1) tree_attention_mma_kernel(const AttentionParams p) {
  using L = AttentionMmaLayout<D, kRowWarps>;
  constexpr int kKeyWarps = kMmaWarps / kRowWarps;
  constexpr int kWarpKeys = kMmaTileKeys / kKeyWarps;  // keys of a tile one warp scores: 16, 32 or 64
  constexpr int kKeyFrags = kWarpKeys / 8;             // n8 tiles of QK^T
  constexpr int kDFrags = D / 8;                       // n8 tiles of PV
  constexpr int kChunks = D / 8;                       // 16-byte chunks per K/V/Q row
  constexpr int kThreads = kMmaWarps * kWarpSize;
  constexpr int kThreadsPerKey = kThreads / kMmaTileKeys;
  static_assert(kThreads % kMmaTileKeys == 0 && kChunks % kThreadsPerKey == 0, "tile loader shape");

  const int split = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row_warp = warp % kRowWarps, key_warp = warp / kRowWarps;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates

  const RequestKeys keys(p, r, h);
  if (keys.q_len <= 0) return;
  const int t0 = keys.t0, group = keys.group, num_rows = keys.num_rows;
  const int num_tiles = div_up(keys.total_keys, kMmaTileKeys);
  const int tiles_per_split = div_up(num_tiles, p.num_splits);
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min_of(num_tiles, tile_begin + tiles_per_split);

  SV_DYNAMIC_SHARED(unsigned char, smem);
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = reinterpret_cast<T*>(smem + L::kQBytes);
  T* v_s = reinterpret_cast<T*>(smem + L::kQBytes + L::kKvBytes / 2);
  int* code_s = reinterpret_cast<int*>(smem + L::kQBytes + L::kKvBytes);
  float* merge_o = reinterpret_cast<float*>(smem + L::kQBytes);  // [warp][16][D], after the key loop
  float* merge_m = merge_o + kMmaWarps * 16 * D;                 // [warp][16]
  float* merge_l = merge_m + kMmaWarps * 16;                     // [warp][16]

  const T* __restrict__ query = static_cast<const T*>(p.query);
  const T* __restrict__ kc = static_cast<const T*>(p.key_cache);
  const T* __restrict__ vc = static_cast<const T*>(p.value_cache);
  const int* table = p.block_table + r * p.bt_stride;

  // Issue the copies of one tile's keys into `stage` and record each key's code (context, query token
  // index, or invalid: zero-filled and masked).
  auto load_tile = [&](int tile, int stage) {
    const int j = tid / kThreadsPerKey;
    int pos;
    const int c = keys.code(p, tile * kMmaTileKeys + j, pos);
    const bool valid = c != kKeyInvalid;
    int64_t phys = 0, off = 0;
    if (valid) {
      phys = table[pos / p.block_size];
      off = pos % p.block_size;
    }
    const T* k_src = kc + phys * p.k_stride_b + h * p.k_stride_h + off * p.k_stride_t;
    const T* v_src = vc + phys * p.v_stride_b + h * p.v_stride_h + off * p.v_stride_t;
    T* k_dst = k_s + size_t(stage) * kMmaTileKeys * L::kStride + j * L::kStride;
    T* v_dst = v_s + size_t(stage) * kMmaTileKeys * L::kStride + j * L::kStride;
#pragma unroll
    for (int i = 0; i < kChunks / kThreadsPerKey; ++i) {
      const int chunk = (tid % kThreadsPerKey) + i * kThreadsPerKey;
      mma::cp_async_16(k_dst + chunk * 8, k_src + chunk * 8, valid);
      mma::cp_async_16(v_dst + chunk * 8, v_src + chunk * 8, valid);
    }
    if (tid % kThreadsPerKey == 0) code_s[stage * kMmaTileKeys + j] = c;
  };

  const float scale_log2 = p.scale * kLog2e;  // softmax in base 2: exp2f is one instruction
  for (int row0 = 0; row0 < num_rows; row0 += L::kRows) {
    __syncthreads();  // the previous pass's merge no longer reads the K/V stages, nor anyone q_s
    for (int i = tid; i < L::kRows * kChunks; i += kThreads) {
      const int row = row0 + i / kChunks, chunk = i % kChunks;
      const bool valid = row < num_rows;
      const T* src = query;
      if (valid) src += (t0 + row / group) * p.q_stride_t + (h * group + row % group) * p.q_stride_h + chunk * 8;
      mma::cp_async_16(q_s + (i / kChunks) * L::kStride + chunk * 8, src, valid);
    }
    if (tile_begin < tile_end) load_tile(tile_begin, 0);
    mma::cp_async_commit();

    float o[kDFrags][4];
#pragma unroll
    for (int n = 0; n < kDFrags; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};  // rows g and g + 8 of this warp's 16
    float row_sum[2] = {0.0f, 0.0f};            // this lane's columns only; reduced over the 4 lanes at the end
    uint32_t q_frag[D / 16][4];
    const int warp_row0 = row0 + row_warp * 16;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) % kMmaStages;
      if (tile + 1 < tile_end) load_tile(tile + 1, stage ^ 1);
      mma::cp_async_commit();  // possibly empty: keeps "all but the newest group" the current tile
      mma::cp_async_wait<1>();
      __syncthreads();
      if (tile == tile_begin) {
#pragma unroll
        for (int kd = 0; kd < D / 16; ++kd) {
          const int row = row_warp * 16 + (lane % 8) + ((lane / 8) & 1) * 8;
          mma::ldmatrix_x4(q_frag[kd], q_s + row * L::kStride + kd * 16 + (lane / 16) * 8);
        }
      }
      const T* ks = k_s + (size_t(stage) * kMmaTileKeys + key_warp * kWarpKeys) * L::kStride;
      const T* vs = v_s + (size_t(stage) * kMmaTileKeys + key_warp * kWarpKeys) * L::kStride;
      const int* codes = code_s + stage * kMmaTileKeys + key_warp * kWarpKeys;

      // S = Q K^T for this warp's 16 rows x kWarpKeys keys.
      float s[kKeyFrags][4];
#pragma unroll
      for (int n = 0; n < kKeyFrags; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < D / 32; ++kd) {
          uint32_t b[4];  // keys n*8.., head dims kd*32 + 0/8/16/24..
          mma::ldmatrix_x4(b, ks + (n * 8 + lane % 8) * L::kStride + kd * 32 + (lane / 8) * 8);
          mma::m16n8k16<T>(s[n], q_frag[2 * kd], b[0], b[1]);
          mma::m16n8k16<T>(s[n], q_frag[2 * kd + 1], b[2], b[3]);
        }
      }
      // Mask, scale, online softmax (base 2).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kKeyFrags; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = warp_row0 + g + (e >= 2 ? 8 : 0);
          const int c = codes[n * 8 + 2 * t + (e & 1)];
          s[n][e] = keys.allows(p, row, c) ? s[n][e] * scale_log2 : -INFINITY;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
        }
      }
      float alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 2));
        const float new_max = fmaxf(row_max[i], tile_max[i]);
        alpha[i] = row_max[i] == -INFINITY ? 0.0f : exp2f(row_max[i] - new_max);
        row_max[i] = new_max;
        row_sum[i] *= alpha[i];
      }
#pragma unroll
      for (int n = 0; n < kKeyFrags; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - row_max[e / 2]);
          row_sum[e / 2] += s[n][e];
        }
      }
#pragma unroll
      for (int n = 0; n < kDFrags; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
      // O += P V: two QK^T accumulator tiles are one A operand (16 rows x 16 keys).
#pragma unroll
      for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
        const uint32_t a[4] = {mma::pack2<T>(s[2 * kk][0], s[2 * kk][1]), mma::pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                               mma::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               mma::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < kDFrags; n += 2) {
          uint32_t b[4];  // keys kk*16 + 0/8.., head dims n*8 and (n+1)*8.., transposed
          mma::ldmatrix_x4_trans(b, vs + (kk * 16 + lane % 8 + ((lane / 8) & 1) * 8) * L::kStride + (n + lane / 16) * 8);
          mma::m16n8k16<T>(o[n], a, b[0], b[1]);
          mma::m16n8k16<T>(o[n + 1], a, b[2], b[3]);
        }
      }
      __syncthreads();  // this stage is refilled by the next iteration's copies
    }
    mma::cp_async_wait<0>();  // the last (empty) group; nothing may land in the stages from here on

    // Each warp's state for its 16 rows -> shared memory; then every (row, dim) merges the key warps.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_sum[i] += __shfl_xor_sync(kFullMask, row_sum[i], 1);
      row_sum[i] += __shfl_xor_sync(kFullMask, row_sum[i], 2);
    }
    float* wo = merge_o + warp * 16 * D;
#pragma unroll
    for (int n = 0; n < kDFrags; ++n) {
      wo[g * D + n * 8 + 2 * t] = o[n][0];
      wo[g * D + n * 8 + 2 * t + 1] = o[n][1];
      wo[(g + 8) * D + n * 8 + 2 * t] = o[n][2];
      wo[(g + 8) * D + n * 8 + 2 * t + 1] = o[n][3];
    }
    if (t == 0) {
      merge_m[warp * 16 + g] = row_max[0];
      merge_m[warp * 16 + g + 8] = row_max[1];
      merge_l[warp * 16 + g] = row_sum[0];
      merge_l[warp * 16 + g + 8] = row_sum[1];
    }
    __syncthreads();
    for (int i = tid; i < L::kRows * D; i += kThreads) {
      const int local = i / D, d = i % D;
      const int row = row0 + local;
      if (row >= num_rows) continue;
      const int rw = local / 16, rr = local % 16;
      float m = -INFINITY;
#pragma unroll
      for (int kw = 0; kw < kKeyWarps; ++kw) m = fmaxf(m, merge_m[(kw * kRowWarps + rw) * 16 + rr]);
      float sum = 0.0f, acc = 0.0f;
      if (m != -INFINITY) {
#pragma unroll
        for (int kw = 0; kw < kKeyWarps; ++kw) {
          const int w = kw * kRowWarps + rw;
          const float mw = merge_m[w * 16 + rr];
          if (mw == -INFINITY) continue;
          const float f = exp2f(mw - m);
          sum += merge_l[w * 16 + rr] * f;
          acc += merge_o[(w * 16 + rr) * D + d] * f;
        }
      }
      const int tok = t0 + row / group, head = h * group + row % group;
      if (p.num_splits == 1) {
        T* out = static_cast<T*>(p.out) + tok * p.out_stride_t + head * p.out_stride_h;
        out[d] = from_float<T>(sum > 0.0f ? acc / sum : 0.0f);  // no allowed key -> zeros
      } else {
        const int64_t idx = (int64_t(split) * p.num_tokens + tok) * p.num_heads + head;
        p.part_out[idx * D + d] = acc;
        if (d == 0) {
          p.part_max[idx] = m == -INFINITY ? -INFINITY : m * kLn2;  // the merge works in base e
          p.part_sum[idx] = sum;
        }
      }
    }
  }
  if (p.num_splits > 1) {
    // The last split of this (request, KV head) to finish merges all splits: no combine launch.
    __shared__ int last_flag;
    if (!arrive_last(p.split_counters + r * p.num_kv_heads + h, p.num_splits, &last_flag)) return;
    float* weights = reinterpret_cast<float*>(smem + L::kQBytes) + warp * kMaxAttnSplits;  // K/V stages are free
    for (int row = warp; row < num_rows; row += kMmaWarps) {
      merge_attention_splits_warp<T>(p, t0 + row / group, h * group + row % group, weights);
    }
  }
}

// One launch: the splits merge in the kernel (p.split_counters). Rows per CTA pass from the most query rows
// a request may have: 16, 32 or 64.
template <typename T, int D, class Launcher>
void launch_attention_mma(const AttentionParams& p, int num_req, int64_t max_rows, const Launcher& launch) {
  const dim3 grid(unsigned(p.num_splits), unsigned(p.num_kv_heads), unsigned(num_req));
  const dim3 block(kMmaWarps * kWarpSize);
  if (max_rows <= 16) {
    launch(grid, block, AttentionMmaLayout<D, 1>::kBytes, tree_attention_mma_kernel<T, D, 1>, p);
  } else if (max_rows <= 32) {
    launch(grid, block, AttentionMmaLayout<D, 2>::kBytes, tree_attention_mma_kernel<T, D, 2>, p);
  } else {
    launch(grid, block, AttentionMmaLayout<D, 4>::kBytes, tree_attention_mma_kernel<T, D, 4>, p);
  }
}

}  // namespace kernels
}  // namespace sparsever
