// Small helpers shared by the CPU kernels: fp32 vector loads from fp32/bf16/fp16 memory, dtype dispatch,
// thread-local scratch. All kernels compute in fp32 and round only their outputs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "torch_api.h"  // parallel_for, at::vec

#include <cstdlib>
#include <cstring>
#include <vector>

// Put before each loop over a register tile's compile-time dimensions (rows, tokens, vectors): fully
// unrolled, the tile's accumulator arrays stay in registers. Without it GCC kept them on the stack and
// stored every accumulator on each step (seen with perf annotate): the bf16 down projection ran at half
// speed at 8-16 tokens.
#define SPARSEVER_UNROLL _Pragma("GCC unroll 16")

namespace sparsever::cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int kVecLen = Vec::size();  // 16 with AVX-512, 8 with AVX2

// Load kVecLen consecutive elements as fp32.
template <typename T>
inline Vec load_f32(const T* p);

template <>
inline Vec load_f32<float>(const float* p) {
  return Vec::loadu(p);
}

template <>
inline Vec load_f32<c10::BFloat16>(const c10::BFloat16* p) {
  // bf16 -> fp32 is a 16-bit left shift of the bits.
#if defined(CPU_CAPABILITY_AVX512)
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#else
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#endif
}

template <>
inline Vec load_f32<c10::Half>(const c10::Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
}

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// Convert n elements to fp32 (dst may be read later by vector code).
template <typename T>
inline void convert_to_f32(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVecLen <= n; i += kVecLen) load_f32<T>(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Store n fp32 values into T (round to nearest even for bf16/fp16, as c10 conversions do).
template <typename T>
inline void store_from_f32(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
    using VT = at::vec::Vectorized<T>;
    for (; i + VT::size() <= n; i += VT::size()) {
      Vec a = Vec::loadu(src + i), b = Vec::loadu(src + i + kVecLen);
      at::vec::convert_from_float<T>(a, b).store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

#if defined(CPU_CAPABILITY_AVX512)
// Functions that use AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16) in a file built for plain AVX-512; they run
// only after rows_bf16_available() (gemv_rows_bf16.h) said the CPU has it.
#define SPARSEVER_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// 32 bf16 values held in an integer vector, as the bf16 dot product takes them.
SPARSEVER_AVX512_BF16 inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
#endif

// A kernel switch that is on unless the environment variable is "0". Read once per op call (a getenv
// is nothing next to a layer's work, but not per parallel task), so a benchmark can time both ways in
// one process.
inline bool env_switch_on(const char* name) {
  const char* env = std::getenv(name);
  return !(env && std::strcmp(env, "0") == 0);
}

// Per-thread growable fp32 scratch (kernels run under at::parallel_for, one buffer per call site+thread).
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

#define SPARSEVER_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)             \
                                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)      \
                                         AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

}  // namespace sparsever::cpu
