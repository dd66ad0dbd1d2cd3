// Tokens quantized to symmetric int8 per row at run time, as the W8A8 (int8_linear) and W4A8 (int4_linear)
// draft linears take them.
#pragma once

#include "cpu_utils.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sparsever::cpu {

// Tokens quantized per row: xu[t, c] = round_half_even(x[t, c] * 127 / amax_t) + 128 (rows of kp bytes,
// padded with 128, i.e. zero), scale[t] = amax_t / 127. The same fp32 operations as the reference. With
// AVX-512, 16 values a step: a scalar loop (nearbyint per value) cost a one-token pass about a fifth of
// its time.
template <typename T>
inline void quantize_tokens(const T* x, int64_t num_tokens, int64_t k, int64_t x_stride, int64_t kp, uint8_t* xu,
                     float* scale) {
  std::vector<float> row(k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    convert_to_f32(x + t * x_stride, row.data(), k);
    int64_t c = 0;
    float amax = 0.f;
#if defined(CPU_CAPABILITY_AVX512)
    __m512 vmax = _mm512_setzero_ps();
    for (; c + 16 <= k; c += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row.data() + c)), vmax);
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
    scale[t] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    uint8_t* q = xu + t * kp;
    c = 0;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    const __m512i offset = _mm512_set1_epi32(128);
    for (; c + 16 <= k; c += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(row.data() + c), vinv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // ties to even
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // (v first: NaN gives -127, as the scalar loop)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), offset)));
    }
#endif
    for (; c < k; ++c) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(row[c] * inv)));  // ties to even
      q[c] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
    }
    std::fill(q + k, q + kp, uint8_t(128));
  }
}

}  // namespace sparsever::cpu
