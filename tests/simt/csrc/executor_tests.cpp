// Kernels that exercise the SIMT executor itself (not the product kernels): shared memory and
// __syncthreads, warp shuffles and votes, barriers inside loops, multi-dimensional blocks, dynamic
// shared memory, atomics across blocks, the errors the executor must report, and the emulated
// tensor-core and asynchronous-copy instructions (csrc/kernels/mma.cuh).
// Built twice by tests/simt/simt_build.py: with the assembly context switch (op namespace simt_test) and with
// -DSIMT_USE_UCONTEXT (namespace simt_test_ucontext).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "kernels/compat.cuh"
#include "kernels/mma.cuh"

#if defined(SIMT_USE_UCONTEXT)
#define SIMT_TEST_NS simt_test_ucontext
#else
#define SIMT_TEST_NS simt_test
#endif

using namespace sparsever::kernels;

namespace {

// Tree reduction in static shared memory, one partial sum per block.
template <int kThreads>
__global__ void block_sum_kernel(const float* __restrict__ x, float* __restrict__ partial, int n) {
  __shared__ float buf[kThreads];
  float v = 0.0f;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) v += x[i];
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {  // barrier inside a loop
    if (threadIdx.x < stride) buf[threadIdx.x] += buf[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = buf[0];
}

// Per-warp results of every shuffle flavour: out[warp_global][lane][k].
__global__ void warp_ops_kernel(const float* __restrict__ x, float* __restrict__ out) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  float v = x[tid];
  float* o = out + size_t(tid) * 6;
  o[0] = warp_reduce_sum(v);
  o[1] = warp_reduce_max(v);
  o[2] = __shfl_sync(kFullMask, v, 5);                // broadcast lane 5
  o[3] = __shfl_down_sync(kFullMask, v, 3);           // own value past the end
  o[4] = __shfl_up_sync(kFullMask, v, 1, 8);          // within segments of 8
  o[5] = float(__popc(__ballot_sync(kFullMask, v > 0.0f)) + (lane == 0 ? 1000 : 0));
}

// Inclusive Hillis-Steele scan in dynamic shared memory over a 2-D block (x fastest, as CUDA linearises).
__global__ void block_scan_2d_kernel(const int* __restrict__ x, int* __restrict__ out) {
  SV_DYNAMIC_SHARED(int, buf);
  const int n = blockDim.x * blockDim.y;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int base = blockIdx.x * n;
  buf[t] = x[base + t];
  __syncthreads();
  for (int offset = 1; offset < n; offset <<= 1) {
    int add = t >= offset ? buf[t - offset] : 0;
    __syncthreads();
    buf[t] += add;
    __syncthreads();
  }
  out[base + t] = buf[t];
}

// Histogram with atomics from many blocks at once (float and int atomics, atomicMax).
__global__ void histogram_kernel(const int* __restrict__ values, int n, int* __restrict__ counts,
                                 float* __restrict__ weights, int* __restrict__ max_value) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    atomicAdd(&counts[values[i]], 1);
    atomicAdd(&weights[values[i]], 0.5f);
    atomicMax(max_value, values[i]);
  }
}

// Threads that return early no longer count in later barriers (Volta+ behaviour).
__global__ void early_exit_kernel(int* __restrict__ out) {
  __shared__ int total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  if (threadIdx.x >= 40) return;
  atomicAdd(&total, 1);
  __syncthreads();
  out[threadIdx.x] = total;
}

// Errors: a __syncthreads in a divergent branch, and a warp shuffle inside a divergent branch.
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void divergent_shuffle_kernel(float* out) {
  float v = float(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(kFullMask, v, 1);  // lanes 16-31 never arrive
  out[threadIdx.x] = v;
}

// cp.async in three groups of one 16-byte copy per thread (the third zero-fills): shared memory observed
// before any wait, after wait_group 2 ... wait_group 0.
__global__ void async_copy_kernel(const int* __restrict__ src, int* __restrict__ out) {
  __shared__ __align__(16) int stage[32][3][4];
  const int t = threadIdx.x;
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < 4; ++i) stage[t][c][i] = -1;
  for (int c = 0; c < 3; ++c) {
    mma::cp_async_16(stage[t][c], src + (t * 3 + c) * 4, c != 2);
    mma::cp_async_commit();
  }
  auto record = [&](int phase) {
    for (int c = 0; c < 3; ++c)
      for (int i = 0; i < 4; ++i) out[((phase * 32 + t) * 3 + c) * 4 + i] = stage[t][c][i];
  };
  record(0);
  mma::cp_async_wait<2>();
  record(1);
  mma::cp_async_wait<1>();
  record(2);
  mma::cp_async_wait<0>();
  record(3);
}

// A [16, 32] x B [32, 16] on one warp, with the operand paths of the tensor-core attention: A by ldmatrix
// (as Q), B once from an [n][k] copy by ldmatrix (as K), once from a [k][n] copy by ldmatrix.trans (as V).
template <typename T>
__global__ void mma_tile_kernel(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ out) {
  constexpr int kStride = 40;  // 32 + 8: padded rows, as in the attention kernel
  __shared__ __align__(16) T a_s[16 * kStride];
  __shared__ __align__(16) T bt_s[16 * kStride];  // [n][k]
  __shared__ __align__(16) T b_s[32 * kStride];   // [k][n]
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * 32; i += 32) {
    const int row = i / 32, k = i % 32;
    a_s[row * kStride + k] = a[i];
  }
  for (int i = lane; i < 32 * 16; i += 32) {
    const int k = i / 16, n = i % 16;
    b_s[k * kStride + n] = b[i];
    bt_s[n * kStride + k] = b[i];
  }
  __syncwarp();
  uint32_t af[2][4];
  for (int ks = 0; ks < 2; ++ks)
    mma::ldmatrix_x4(af[ks], a_s + (lane % 8 + ((lane / 8) & 1) * 8) * kStride + ks * 16 + (lane / 16) * 8);
  float d_k[2][4] = {}, d_v[2][4] = {};
  for (int n = 0; n < 2; ++n) {
    uint32_t bf[4];
    mma::ldmatrix_x4(bf, bt_s + (n * 8 + lane % 8) * kStride + (lane / 8) * 8);
    mma::m16n8k16<T>(d_k[n], af[0], bf[0], bf[1]);
    mma::m16n8k16<T>(d_k[n], af[1], bf[2], bf[3]);
  }
  for (int ks = 0; ks < 2; ++ks) {
    uint32_t bf[4];
    mma::ldmatrix_x4_trans(bf, b_s + (ks * 16 + lane % 8 + ((lane / 8) & 1) * 8) * kStride + (lane / 16) * 8);
    mma::m16n8k16<T>(d_v[0], af[ks], bf[0], bf[1]);
    mma::m16n8k16<T>(d_v[1], af[ks], bf[2], bf[3]);
  }
  for (int n = 0; n < 2; ++n) {
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * t + (e & 1);
      out[row * 16 + col] = d_k[n][e];
      out[256 + row * 16 + col] = d_v[n][e];
    }
  }
}

at::Tensor block_sum(const at::Tensor& x, int64_t num_blocks) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat);
  auto partial = at::empty({num_blocks}, x.options());
  simt::launch(dim3(num_blocks), dim3(128), 0, block_sum_kernel<128>, x.data_ptr<float>(),
               partial.data_ptr<float>(), int(x.numel()));
  return partial;
}

at::Tensor warp_ops(const at::Tensor& x, int64_t threads_per_block) {
  TORCH_CHECK(x.is_contiguous() && x.numel() % threads_per_block == 0);
  auto out = at::empty({x.numel(), 6}, x.options());
  simt::launch(dim3(x.numel() / threads_per_block), dim3(threads_per_block), 0, warp_ops_kernel,
               x.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

at::Tensor block_scan_2d(const at::Tensor& x, int64_t bx, int64_t by) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kInt && x.numel() % (bx * by) == 0);
  auto out = at::empty_like(x);
  simt::launch(dim3(x.numel() / (bx * by)), dim3(bx, by), bx * by * sizeof(int), block_scan_2d_kernel,
               x.data_ptr<int>(), out.data_ptr<int>());
  return out;
}

std::vector<at::Tensor> histogram(const at::Tensor& values, int64_t bins, int64_t num_blocks) {
  auto counts = at::zeros({bins}, values.options());
  auto weights = at::zeros({bins}, values.options().dtype(at::kFloat));
  auto max_value = at::zeros({1}, values.options());
  simt::launch(dim3(num_blocks), dim3(64), 0, histogram_kernel, values.data_ptr<int>(), int(values.numel()),
               counts.data_ptr<int>(), weights.data_ptr<float>(), max_value.data_ptr<int>());
  return {counts, weights, max_value};
}

at::Tensor early_exit() {
  auto out = at::full({64}, -1, at::TensorOptions().dtype(at::kInt));
  simt::launch(dim3(1), dim3(64), 0, early_exit_kernel, out.data_ptr<int>());
  return out;
}

void divergent_barrier() {
  auto out = at::zeros({64}, at::TensorOptions().dtype(at::kInt));
  simt::launch(dim3(1), dim3(64), 0, divergent_barrier_kernel, out.data_ptr<int>());
}

void divergent_shuffle() {
  auto out = at::zeros({32}, at::TensorOptions().dtype(at::kFloat));
  simt::launch(dim3(1), dim3(32), 0, divergent_shuffle_kernel, out.data_ptr<float>());
}

at::Tensor async_copy(const at::Tensor& src) {
  TORCH_CHECK(src.is_contiguous() && src.scalar_type() == at::kInt && src.numel() == 32 * 3 * 4);
  auto out = at::empty({4, 32, 3, 4}, src.options());
  simt::launch(dim3(1), dim3(32), 0, async_copy_kernel, src.data_ptr<int>(), out.data_ptr<int>());
  return out;
}

at::Tensor mma_tile(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == at::IntArrayRef({16, 32}) &&
              b.sizes() == at::IntArrayRef({32, 16}) && a.scalar_type() == b.scalar_type());
  auto out = at::empty({2, 16, 16}, a.options().dtype(at::kFloat));
  if (a.scalar_type() == at::kBFloat16) {
    simt::launch(dim3(1), dim3(32), 0, mma_tile_kernel<c10::BFloat16>, a.data_ptr<c10::BFloat16>(),
                 b.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(a.scalar_type() == at::kHalf, "bf16 or fp16");
    simt::launch(dim3(1), dim3(32), 0, mma_tile_kernel<c10::Half>, a.data_ptr<c10::Half>(), b.data_ptr<c10::Half>(),
                 out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(SIMT_TEST_NS, m) {
  m.def("async_copy(Tensor src) -> Tensor", &async_copy);
  m.def("mma_tile(Tensor a, Tensor b) -> Tensor", &mma_tile);
  m.def("block_sum(Tensor x, int num_blocks) -> Tensor", &block_sum);
  m.def("warp_ops(Tensor x, int threads_per_block) -> Tensor", &warp_ops);
  m.def("block_scan_2d(Tensor x, int bx, int by) -> Tensor", &block_scan_2d);
  m.def("histogram(Tensor values, int bins, int num_blocks) -> Tensor[]", &histogram);
  m.def("early_exit() -> Tensor", &early_exit);
  m.def("divergent_barrier() -> ()", &divergent_barrier);
  m.def("divergent_shuffle() -> ()", &divergent_shuffle);
}
