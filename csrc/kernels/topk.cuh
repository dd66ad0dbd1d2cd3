// Block-wide exact top-k over float scores, the selection rule of every sparsever op (reference.py's
// topk_lower_index_wins): larger score first, among equal scores the lower index wins, and the chosen
// indices come out in ascending order. Radix select (4 passes of 8 bits over order-preserving keys) finds
// the k-th largest key, then one ordered compaction pass writes the winners; no sorting, O(n) reads per pass.
#pragma once

#include "compat.cuh"

namespace sparsever {
namespace kernels {

// Monotone float -> uint32 map (a < b  <=>  key(a) < key(b)); -0.0 and +0.0 map to the same key because
// the reference compares them as equal.
SV_DEVICE unsigned order_key(float x) {
  if (x == 0.0f) x = 0.0f;
  unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct BlockTopkScratch {
  unsigned hist[256];
  unsigned prefix;     // key bits fixed so far
  unsigned remaining;  // how many of the top-k are still to be found below the fixed prefix
  int warp_gt[32];
  int warp_eq[32];
  int running_gt;
  int running_eq;
};

// All threads of the block call this (blockDim.x a multiple of 32, blockDim.y == blockDim.z == 1).
// score(i) for i in [0, n) may be evaluated several times and must return the same value each time.
// Writes min(k, n) indices to out[0..) ascending (out may be global or shared memory).
template <typename ScoreFn>
SV_DEVICE void block_topk_ascending(ScoreFn score, int n, int k, int* out, BlockTopkScratch& s) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_warps = nthreads / kWarpSize;
  if (k >= n) {
    for (int i = tid; i < n; i += nthreads) out[i] = i;
    return;
  }
  if (k <= 0) return;

  if (tid == 0) {
    s.prefix = 0;
    s.remaining = unsigned(k);
    s.running_gt = 0;
    s.running_eq = 0;
  }
  unsigned mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += nthreads) s.hist[i] = 0;
    __syncthreads();
    const unsigned prefix = s.prefix;
    // Scores of one magnitude share their high digits, so per-key shared-memory atomics would pile onto a few
    // bins and serialise: the lanes of a warp that hold one digit add their count once (warp-aggregated).
    for (int base = 0; base < n; base += nthreads) {  // whole warps iterate together (match_any below)
      const int i = base + tid;
      const unsigned key = i < n ? order_key(score(i)) : 0u;
      const bool counted = i < n && (key & mask) == prefix;
      const unsigned digit = counted ? (key >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(kFullMask, digit);
      if (counted && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(&s.hist[digit], unsigned(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l owns digits [8l, 8l+8); find the digit where the count of larger keys crosses `remaining`.
      const unsigned remaining = s.remaining;  // read before any lane can update it
      unsigned local = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) local += s.hist[lane * 8 + b];
      unsigned suffix = local;  // keys in digits owned by lanes >= this one
#pragma unroll
      for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        unsigned v = __shfl_down_sync(kFullMask, suffix, offset);
        if (lane + offset < kWarpSize) suffix += v;
      }
      const unsigned above = suffix - local;
      // Every lane's reads of s.remaining and s.hist complete before the crossing lane writes s.remaining:
      // lanes are not in lockstep (independent thread scheduling), so the shuffles alone do not order them.
      __syncwarp();
      if (above < remaining && remaining <= suffix) {
        unsigned acc = above;
        for (int b = 7; b >= 0; --b) {
          unsigned c = s.hist[lane * 8 + b];
          if (acc + c >= remaining) {
            s.prefix = prefix | (unsigned(lane * 8 + b) << shift);
            s.remaining = remaining - acc;
            break;
          }
          acc += c;
        }
      }
    }
    mask |= 255u << shift;
    __syncthreads();
  }
  // Keys above the threshold all win; of the keys equal to it, the first `need_eq` in index order win.
  const unsigned threshold = s.prefix;
  const int need_eq = int(s.remaining);
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = 0; base < n; base += nthreads) {
    const int i = base + tid;
    unsigned key = i < n ? order_key(score(i)) : 0u;
    const bool gt = i < n && key > threshold;
    const bool eq = i < n && key == threshold;
    const unsigned bal_gt = __ballot_sync(kFullMask, gt);
    const unsigned bal_eq = __ballot_sync(kFullMask, eq);
    if (lane == 0) {
      s.warp_gt[warp] = __popc(bal_gt);
      s.warp_eq[warp] = __popc(bal_eq);
    }
    __syncthreads();
    int gt_before = s.running_gt + __popc(bal_gt & lanes_below);
    int eq_before = s.running_eq + __popc(bal_eq & lanes_below);
    int total_gt = 0, total_eq = 0;
    for (int w = 0; w < num_warps; ++w) {
      if (w < warp) {
        gt_before += s.warp_gt[w];
        eq_before += s.warp_eq[w];
      }
      total_gt += s.warp_gt[w];
      total_eq += s.warp_eq[w];
    }
    if (gt || (eq && eq_before < need_eq)) out[gt_before + min_of(eq_before, need_eq)] = i;
    __syncthreads();
    if (tid == 0) {
      s.running_gt += total_gt;
      s.running_eq += total_eq;
    }
    __syncthreads();
  }
}

}  // namespace kernels
}  // namespace sparsever
