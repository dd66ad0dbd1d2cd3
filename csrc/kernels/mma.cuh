// Warp-level tensor-core and asynchronous-copy instructions (sm_80+): mma.sync m16n8k16 (bf16/fp16 in,
// fp32 accumulate), ldmatrix (plain and .trans), cp.async 16-byte copies with commit/wait groups.
//
// Under nvcc for sm_80+ each is one PTX instruction. In the SIMT executor (tests) each is emulated with the
// fragment layouts of the PTX ISA ("Matrix fragments for mma.m16n8k16 with floating point type",
// "Warp-level matrix load instruction: ldmatrix"), so a kernel that puts an element in the wrong register
// computes a wrong result on the CPU too:
//   groupID g = lane / 4, t = lane % 4; each .b32 register holds two 16-bit elements, the lower column
//   (A, C) or row (B) in the low half.
//   A (16x16, row-major):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (16x8,  "col"):      b0 (k = 2t..2t+1, n = g)           b1 (k = 2t+8.., n = g)
//   C/D (16x8, fp32):      c0 c1 (g, 2t..2t+1)                c2 c3 (g+8, 2t..2t+1)
//   ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i (8 rows of 8 16-bit elements, 16 bytes
//   each); register i of lane l receives row l/4, elements 2(l%4) and 2(l%4)+1 of matrix i (.trans: the
//   elements (2(l%4), l/4) and (2(l%4)+1, l/4)).
//   cp.async lands in shared memory at the thread's wait_group (see simt.h), never earlier.
// The real instructions' agreement with these layouts is checked on a GPU by the kit (bench/gpu/check.py
// runs the kernels that use them against the reference).
#pragma once

#include <type_traits>

#include "compat.cuh"

namespace sparsever {
namespace kernels {
namespace mma {

#if defined(__CUDACC__)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// Kernels using this header are only launched on sm_80+ (the launcher checks the device); older targets
// compile them to a trap.
#define SV_MMA_UNSUPPORTED 1
#endif

SV_DEVICE uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Two fp32 values rounded to nearest-even into one bf16x2 / f16x2 register (`lo` in the low half).
template <typename T>
SV_DEVICE uint32_t pack2(float lo, float hi) {
  uint32_t d = 0;
#if !defined(SV_MMA_UNSUPPORTED)
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
#endif
  return d;
}

// d += a * b for one 16x8x16 tile.
template <typename T>
SV_DEVICE void m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(SV_MMA_UNSUPPORTED)
  __trap();
#else
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// Four 8x8 16-bit matrices from shared memory (transposed with kTrans); `row` is this lane's row address
// (16-byte aligned).
template <bool kTrans>
SV_DEVICE void ldmatrix(uint32_t (&r)[4], const void* row) {
#if defined(SV_MMA_UNSUPPORTED)
  __trap();
#else
#define SV_LDMATRIX(op) asm volatile(op " {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row)))
  if constexpr (kTrans) {
    SV_LDMATRIX("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16");
  } else {
    SV_LDMATRIX("ldmatrix.sync.aligned.m8n8.x4.shared.b16");
  }
#undef SV_LDMATRIX
#endif
}

// 16 bytes global -> shared, bypassing L1 (.cg); `valid == false` zero-fills the destination instead.
SV_DEVICE void cp_async_16(void* smem, const void* global, bool valid) {
#if defined(SV_MMA_UNSUPPORTED)
  __trap();
#else
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem)), "l"(global),
               "r"(src_bytes));
#endif
}

SV_DEVICE void cp_async_commit() {
#if !defined(SV_MMA_UNSUPPORTED)
  asm volatile("cp.async.commit_group;");
#endif
}

// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
SV_DEVICE void cp_async_wait() {
#if !defined(SV_MMA_UNSUPPORTED)
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
#endif
}

#else  // SIMT executor: emulation with the PTX ISA's fragment layouts

template <typename T>
inline uint16_t bits_of(float x) {
  return T(x).x;  // c10's float -> bf16 / fp16 conversions round to nearest-even, as cvt.rn does
}

template <typename T>
inline float float_of(uint16_t bits) {
  return static_cast<float>(T(bits, T::from_bits()));
}

template <typename T>
inline uint32_t pack2(float lo, float hi) {
  return uint32_t(bits_of<T>(lo)) | (uint32_t(bits_of<T>(hi)) << 16);
}

template <typename T>
inline float half_of(uint32_t reg, int which) {
  return float_of<T>(uint16_t(which == 0 ? reg & 0xffffu : reg >> 16));
}

struct AFragment {
  uint32_t r[4];
};
struct BFragment {
  uint32_t r[2];
};

template <typename T>
inline void m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  AFragment all_a[kWarpSize];
  BFragment all_b[kWarpSize];
  ::simt::detail::warp_allgather(AFragment{{a[0], a[1], a[2], a[3]}}, all_a);
  ::simt::detail::warp_allgather(BFragment{{b0, b1}}, all_b);
  float A[16][16], B[16][8];
  for (int l = 0; l < kWarpSize; ++l) {
    const int g = l / 4, t = l % 4;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = half_of<T>(all_a[l].r[0], e);
      A[g + 8][2 * t + e] = half_of<T>(all_a[l].r[1], e);
      A[g][2 * t + 8 + e] = half_of<T>(all_a[l].r[2], e);
      A[g + 8][2 * t + 8 + e] = half_of<T>(all_a[l].r[3], e);
      B[2 * t + e][g] = half_of<T>(all_b[l].r[0], e);
      B[2 * t + 8 + e][g] = half_of<T>(all_b[l].r[1], e);
    }
  }
  const int lane = int(::simt::detail::lane_id());
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum = std::fma(A[row][k], B[k][col], sum);  // exact products in fp32
    d[i] += sum;
  }
  if (lane == 0) ++::simt::counters().mma;
}

template <bool kTrans>
inline void ldmatrix(uint32_t (&r)[4], const void* row) {
  const void* rows[kWarpSize];
  ::simt::detail::warp_allgather(row, rows);
  const int lane = int(::simt::detail::lane_id());
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) ::simt::detail::abandon("simt: ldmatrix row address not 16-byte aligned");
  for (int i = 0; i < 4; ++i) {
    uint16_t e[2];
    for (int j = 0; j < 2; ++j) {
      const int rr = kTrans ? 2 * (lane % 4) + j : lane / 4;  // row of matrix i
      const int cc = kTrans ? lane / 4 : 2 * (lane % 4) + j;  // element within that row
      e[j] = static_cast<const uint16_t*>(rows[8 * i + rr])[cc];
    }
    r[i] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
  }
  if (lane == 0) ++::simt::counters().ldmatrix;
}

inline void cp_async_16(void* smem, const void* global, bool valid) {
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 || (valid && reinterpret_cast<uintptr_t>(global) % 16 != 0)) {
    ::simt::detail::abandon("simt: cp.async of 16 bytes needs 16-byte aligned addresses");
  }
  ::simt::async_copy(smem, global, 16, valid ? 16 : 0);
}
inline void cp_async_commit() { ::simt::async_commit_group(); }
template <int kPending>
inline void cp_async_wait() {
  ::simt::async_wait_group(kPending);
}

#endif  // __CUDACC__

SV_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix<false>(r, row); }
SV_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { ldmatrix<true>(r, row); }

}  // namespace mma
}  // namespace kernels
}  // namespace sparsever
