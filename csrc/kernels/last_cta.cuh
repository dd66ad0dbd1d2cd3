// "The last CTA of a group finishes the job": the CTAs of a group (e.g. the splits of one (request, KV head))
// write their partial results, then count their arrival; the one that arrives last merges them. A reduction
// that would take a second kernel launch takes none (FlashDecoding needs two; CUB's single-pass scans and the
// CUDA samples' threadFenceReduction use this pattern).
//
// The counters are zeroed once per device and left at zero by every group's last CTA, so a call needs no
// memset and a CUDA graph replays it as captured. Kernels on one stream use them one after the other; two
// streams running these kernels at once would need counters of their own.
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include "compat.cuh"

namespace sparsever {
namespace kernels {

// `count` zeroed int32 counters on `like`'s device (grown, never shrunk; at least 64K).
inline int* arrival_counters(const at::Tensor& like, int64_t count) {
  static std::mutex mutex;
  // Never destroyed: freeing device memory after the CUDA runtime has shut down at exit would crash.
  static auto* buffers = new std::map<std::pair<int, int>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buf = (*buffers)[{int(like.device().type()), int(like.device().index())}];
  if (!buf.defined() || buf.numel() < count) {
    buf = at::zeros({std::max<int64_t>(count, int64_t(1) << 16)}, like.options().dtype(at::kInt));
  }
  return buf.data_ptr<int>();
}

// Called by every thread of every CTA of the group, after the CTA's writes that the last one will read.
// True in the last CTA to arrive (in all its threads), which then reads the others' writes with __ldcg.
// `flag` is one int of shared memory.
SV_DEVICE bool arrive_last(int* counter, int group_size, int* flag) {
  __threadfence();  // this CTA's writes are visible device-wide before its arrival is
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1) == group_size - 1;
    if (last) atomicExch(counter, 0);  // ready for the next launch
    *flag = last;
  }
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

}  // namespace kernels
}  // namespace sparsever
