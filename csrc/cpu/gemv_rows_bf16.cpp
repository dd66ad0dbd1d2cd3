// AVX512-BF16 row kernels for the few-token SwiGLU projections (see gemv_rows_bf16.h).
//
// Up (rows_dot): a 4-row x 4-token register tile; each 64-byte load of a weight row (32 bf16) meets the
// same 32 channels of each token in one vdpbf16ps; sums are reduced across lanes once per tile.
// Down (rows_axpy): rows are taken two at a time; unpacklo/hi_epi16 interleave their columns into the
// (row j, row j+1) pairs vdpbf16ps multiplies by the broadcast pair (a[t, j], a[t, j+1]). The unpack
// works within 128-bit lanes, so a 32-column chunk accumulates in a fixed column permutation that is
// undone once, after all rows. Each thread takes a share of the row pairs and walks them in blocks of 8
// pairs along the whole row (its own partial sums of every column; the threads' partials are added at
// the end): every selected row is read start to end by one thread. On a Zen 5 EPYC this was 8-22%
// faster at 4-8 tokens than giving each thread a column slab of every row (interleaved A/B, 2026-11-25).
#include "gemv_rows_bf16.h"

#include "cpu_utils.h"
#include "gemv_rows.h"  // before the target pragma: its inline functions stay plain AVX-512

#include <algorithm>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace sparsever::cpu {
namespace {

// next: the next tile's rows (or null): one cache line of each is prefetched per 64-byte step whose number
// is pf_phase modulo pf_every, so the next tile streams in while this one (and the other token tiles of
// this row tile) computes: spread out, not a burst that fills the miss buffers.
template <int NR, int NT>
inline void dot_tile_bf16(const uint16_t* x, int64_t h, const uint16_t* const* rows, float* y, int64_t ys,
                          const uint16_t* const* next, int nn, int pf_phase, int pf_every) {
  __m512 acc[NR][NT];
  SPARSEVER_UNROLL
  for (int i = 0; i < NR; ++i)
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (int64_t step = 0; c + 32 <= h; c += 32, ++step) {
    if (step % pf_every == pf_phase)
      SPARSEVER_UNROLL
      for (int i = 0; i < nn; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + c), _MM_HINT_T0);
    __m512bh xv[NT];
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = as_bh(_mm512_loadu_si512(x + t * h + c));
    SPARSEVER_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = as_bh(_mm512_loadu_si512(rows[i] + c));
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv, xv[t]);
    }
  }
  if (c < h) {  // tail: masked (zeroed) loads
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (h - c)) - 1);
    __m512bh xv[NT];
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = as_bh(_mm512_maskz_loadu_epi16(m, x + t * h + c));
    SPARSEVER_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = as_bh(_mm512_maskz_loadu_epi16(m, rows[i] + c));
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv, xv[t]);
    }
  }
  SPARSEVER_UNROLL
  for (int i = 0; i < NR; ++i)
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) y[t * ys + i] = _mm512_reduce_add_ps(acc[i][t]);
}

// One (token tile x NV 32-column chunks) over row pairs [q0, q1); chunk cc starts at column 32 * cc.
// buf holds the partial sums in the unpack order: per chunk, 16 "lo" then 16 "hi" lanes.
template <int NT, int NV>
inline void axpy_tile_bf16(const uint32_t* ap, int64_t kp, const uint16_t* const* rows, int64_t q0, int64_t q1,
                           int64_t cc, int64_t h, bool accumulate, float* buf, int64_t buf_stride) {
  __m512 lo[NT][NV], hi[NT][NV];
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t)
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) {
      float* b = buf + t * buf_stride + v * 32;
      lo[t][v] = accumulate ? _mm512_loadu_ps(b) : _mm512_setzero_ps();
      hi[t][v] = accumulate ? _mm512_loadu_ps(b + 16) : _mm512_setzero_ps();
    }
  const int64_t c0 = cc * 32;
  __mmask32 masks[NV];
  SPARSEVER_UNROLL
  for (int v = 0; v < NV; ++v) {
    const int64_t left = h - (c0 + v * 32);
    masks[v] = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << std::max<int64_t>(0, left)) - 1);
  }
  for (int64_t q = q0; q < q1; ++q) {
    const uint16_t* ra = rows[2 * q] + c0;
    const uint16_t* rb = rows[2 * q + 1] + c0;
    __m512bh s[NT];
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) s[t] = as_bh(_mm512_set1_epi32(static_cast<int>(ap[t * kp + q])));
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) {
      const __m512i wa = _mm512_maskz_loadu_epi16(masks[v], ra + v * 32);
      const __m512i wb = _mm512_maskz_loadu_epi16(masks[v], rb + v * 32);
      const __m512bh wl = as_bh(_mm512_unpacklo_epi16(wa, wb)), wh = as_bh(_mm512_unpackhi_epi16(wa, wb));
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) {
        lo[t][v] = _mm512_dpbf16_ps(lo[t][v], wl, s[t]);
        hi[t][v] = _mm512_dpbf16_ps(hi[t][v], wh, s[t]);
      }
    }
  }
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t)
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) {
      float* b = buf + t * buf_stride + v * 32;
      _mm512_storeu_ps(b, lo[t][v]);
      _mm512_storeu_ps(b + 16, hi[t][v]);
    }
}

template <int NV>
inline void axpy_chunk_bf16(const uint32_t* ap, int64_t nt, int64_t kp, const uint16_t* const* rows, int64_t q0,
                            int64_t q1, int64_t cc, int64_t h, bool acc, float* buf, int64_t bs) {
  for_each_token_tile(nt, [&](auto tile, int64_t t) {
    axpy_tile_bf16<decltype(tile)::value, NV>(ap + t * kp, kp, rows, q0, q1, cc, h, acc, buf + t * bs, bs);
  });
}

// Undo the unpack order of one 32-column chunk: lanes 4l+m of lo / hi hold columns 8l+m / 8l+4+m.
inline void store_chunk_bf16(const float* b, float* out, int64_t cols) {
  const __m512 lo = _mm512_loadu_ps(b), hi = _mm512_loadu_ps(b + 16);
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 c0 = _mm512_permutex2var_ps(lo, i0, hi), c1 = _mm512_permutex2var_ps(lo, i1, hi);
  const int64_t n0 = std::min<int64_t>(16, cols), n1 = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n0) - 1), c0);
  _mm512_mask_storeu_ps(out + 16, static_cast<__mmask16>((1u << n1) - 1), c1);
}

// Row pairs [p0, p1) of rows_axpy over every column, in blocks of kPairBlock pairs (the next block's
// columns prefetched a chunk step at a time); sums in buf [nt, chunks * 32] in the unpack order, overwritten.
void axpy_pairs_bf16(const uint32_t* ap, int64_t nt, int64_t kp, const uint16_t* const* rows, int64_t p0,
                     int64_t p1, int64_t h, float* buf) {
  constexpr int64_t kPairBlock = 8;
  // 32-column chunks per register tile: 4 (8 sums per token) for one or two tokens, enough independent
  // vdpbf16ps chains (measured faster than 2 there; docs/kernels.md); else 2 (16 sums for 4 tokens).
  const int kChunks = nt <= 2 ? 4 : 2;
  const int64_t chunks = (h + 31) / 32, bs = chunks * 32;
  for (int64_t r = 2 * p0; r < 2 * std::min(p1, p0 + kPairBlock); ++r)  // the first block
    for (int64_t b = 0; b < h * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[r]) + b, _MM_HINT_T0);
  for (int64_t q0 = p0; q0 < p1; q0 += kPairBlock) {
    const int64_t q1 = std::min(p1, q0 + kPairBlock);
    const int64_t r_next_end = 2 * std::min(p1, q1 + kPairBlock);
    for (int64_t cc = 0; cc < chunks;) {
      const int nv = static_cast<int>(std::min<int64_t>(kChunks, chunks - cc));
      const int64_t pb = cc * 64, pe = std::min(h, (cc + nv) * 32) * 2;
      for (int64_t r = 2 * q1; r < r_next_end; ++r)
        for (int64_t b = pb; b < pe; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[r]) + b, _MM_HINT_T0);
      const bool acc = q0 > p0;
      switch (nv) {
        case 4: axpy_chunk_bf16<4>(ap, nt, kp, rows, q0, q1, cc, h, acc, buf + cc * 32, bs); break;
        case 3: axpy_chunk_bf16<3>(ap, nt, kp, rows, q0, q1, cc, h, acc, buf + cc * 32, bs); break;
        case 2: axpy_chunk_bf16<2>(ap, nt, kp, rows, q0, q1, cc, h, acc, buf + cc * 32, bs); break;
        default: axpy_chunk_bf16<1>(ap, nt, kp, rows, q0, q1, cc, h, acc, buf + cc * 32, bs); break;
      }
      cc += nv;
    }
  }
}

// With more than 4 tokens a row tile is computed once per 4-token tile; later token tiles re-read its rows
// from cache. spread_prefetch: the next row tile's lines are prefetched a share per token tile, so memory
// streams during all of them; else during the first token tile only (pf_every 1: the phase of every later
// tile, 1, 2, ..., never matches step % 1).
void rows_dot_range_bf16_impl(const c10::BFloat16* x, int64_t nt, int64_t h, const c10::BFloat16* w,
                              int64_t stride, const int32_t* idx, int64_t r0, int64_t r1, float* y, int64_t ys,
                              bool spread_prefetch) {
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  const int pf_every = spread_prefetch ? static_cast<int>((nt + 3) / 4) : 1;  // token tiles sharing the prefetch
  for_each_row_tile(reinterpret_cast<const uint16_t*>(w), stride, idx, h, r0, r1,
                    [&](auto nr, const uint16_t* const* rows, int64_t j0, const uint16_t* const* next, int nn) {
                      for_each_token_tile(nt, [&](auto tile, int64_t t) {
                        dot_tile_bf16<decltype(nr)::value, decltype(tile)::value>(
                            xb + t * h, h, rows, y + t * ys + j0, ys, next, nn, static_cast<int>(t / 4), pf_every);
                      });
                    });
}

}  // namespace
}  // namespace sparsever::cpu
#pragma GCC pop_options
#endif  // CPU_CAPABILITY_AVX512

namespace sparsever::cpu {

bool rows_bf16_available() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void rows_dot_range_bf16(const c10::BFloat16* x, int64_t num_tokens, int64_t h, const c10::BFloat16* w,
                         int64_t w_row_stride, const int32_t* idx, int64_t row_begin, int64_t row_end, float* y,
                         int64_t y_stride, bool spread_prefetch) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(rows_bf16_available(), "rows_dot_range_bf16 needs AVX512-BF16");
  rows_dot_range_bf16_impl(x, num_tokens, h, w, w_row_stride, idx, row_begin, row_end, y, y_stride, spread_prefetch);
#else
  TORCH_CHECK(false, "rows_dot_range_bf16 needs the AVX-512 build");
#endif
}

void rows_axpy_bf16(const float* a, int64_t num_tokens, int64_t k, const c10::BFloat16* w, int64_t w_row_stride,
                    const int32_t* idx, int64_t h, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(rows_bf16_available(), "rows_axpy_bf16 needs AVX512-BF16");
  if (num_tokens == 0) return;
  if (k == 0) {
    std::fill(out, out + num_tokens * h, 0.f);
    return;
  }
  // Row pairs: the activations as bf16 pairs (a[t, 2q], a[t, 2q + 1]); an odd last row pairs with zeros.
  const int64_t kp = (k + 1) / 2;
  std::vector<uint32_t> ap(static_cast<size_t>(num_tokens * kp));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t q = 0; q < kp; ++q) {
      const uint16_t lo = c10::BFloat16(a[t * k + 2 * q]).x;
      const uint16_t hi = 2 * q + 1 < k ? c10::BFloat16(a[t * k + 2 * q + 1]).x : uint16_t{0};
      ap[t * kp + q] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  const auto* wb = reinterpret_cast<const uint16_t*>(w);
  std::vector<uint16_t> zeros(k % 2 ? static_cast<size_t>(h) : 0, 0);
  std::vector<const uint16_t*> rows(static_cast<size_t>(2 * kp));
  for (int64_t j = 0; j < k; ++j) rows[j] = wb + (idx ? idx[j] : j) * w_row_stride;
  if (k % 2) rows[k] = zeros.data();
  // Each thread's share of the row pairs into partial sums of every column (unpack order), summed.
  constexpr int64_t kMinPairsPerShare = 8;
  const int64_t chunks = (h + 31) / 32, bs = chunks * 32;
  std::vector<float> sum(static_cast<size_t>(num_tokens * bs));
  sum_over_row_shares(kp, kMinPairsPerShare, num_tokens * bs, sum.data(), [&](int64_t p0, int64_t p1, float* buf) {
    axpy_pairs_bf16(ap.data(), num_tokens, kp, rows.data(), p0, p1, h, buf);
  });
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t cc = 0; cc < chunks; ++cc)
      store_chunk_bf16(sum.data() + t * bs + cc * 32, out + t * h + cc * 32, std::min<int64_t>(32, h - cc * 32));
#else
  TORCH_CHECK(false, "rows_axpy_bf16 needs the AVX-512 build");
#endif
}

}  // namespace sparsever::cpu

bool bf16_dot_available() { return sparsever::cpu::rows_bf16_available(); }
