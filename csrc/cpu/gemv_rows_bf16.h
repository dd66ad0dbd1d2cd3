// bf16 weight-streaming kernels on vLLM's own row-major weights with AVX512-BF16 (`vdpbf16ps`): the
// few-token up and down projections of topk_swiglu_ffn without widening every weight to fp32 (one
// instruction does 32 multiply-adds per token). Same contracts as rows_dot_range / rows_axpy in
// gemv_rows.h, except that the activations are bf16 (x: the layer input; a: the SwiGLU product rounded
// to bf16 pairs, as a bf16 MLP rounds it). Only called where rows_bf16_available().
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace sparsever::cpu {

// True on AVX-512 builds running on a CPU with AVX512-BF16.
bool rows_bf16_available();

// Y[t, j] = X[t, :] . W[row(j), :] for output rows [row_begin, row_end); X bf16 [T, H] contiguous.
// spread_prefetch: with more than 4 tokens, the next rows are prefetched during every 4-token tile, not
// only the first (the default; false only to time the old way, SPARSEVER_CPU_FFN_SPREAD_PREFETCH=0).
void rows_dot_range_bf16(const c10::BFloat16* x, int64_t num_tokens, int64_t h, const c10::BFloat16* w,
                         int64_t w_row_stride, const int32_t* idx, int64_t row_begin, int64_t row_end, float* y,
                         int64_t y_stride, bool spread_prefetch = true);

// OUT[t, :] = sum_j A[t, j] * W[row(j), :] (A fp32 [T, K], rounded to bf16 inside; OUT fp32 [T, H]
// contiguous, overwritten). Parallel over shares of the selected rows.
void rows_axpy_bf16(const float* a, int64_t num_tokens, int64_t k, const c10::BFloat16* w, int64_t w_row_stride,
                    const int32_t* idx, int64_t h, float* out);

}  // namespace sparsever::cpu
