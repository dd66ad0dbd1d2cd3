// Weight-streaming kernels for few-token (verification) shapes: each selected weight row is read from
// memory once per call and reused for every token while it sits in L1/L2. Activations are fp32.
#pragma once

#include "cpu_utils.h"

#include <type_traits>

namespace sparsever::cpu {

// Y[t, j] = X[t, :] . W[row(j), :], row(j) = idx ? idx[j] : j; X [T, H] fp32 contiguous; Y row stride y_stride.
// next: the next tile's rows (nn of them): prefetched along with this tile's loads, a line at a time, so
// they stream in while this tile computes (a burst of prefetches would fill the miss buffers and stall).
template <int NR, int NT, typename WT>
inline void dot_tile(const float* x, int64_t h, const WT* const* wrows, float* y, int64_t y_stride,
                     const WT* const* next, int nn) {
  constexpr int64_t kLineElems = 64 / sizeof(WT);
  Vec acc[NR][NT];
  SPARSEVER_UNROLL
  for (int i = 0; i < NR; ++i)
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) acc[i][t] = Vec(0.f);
  int64_t c = 0;
  for (; c + kVecLen <= h; c += kVecLen) {
    if (c % kLineElems == 0)
      SPARSEVER_UNROLL
      for (int i = 0; i < nn; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + c), _MM_HINT_T0);
    Vec xv[NT];
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = Vec::loadu(x + t * h + c);
    SPARSEVER_UNROLL
    for (int i = 0; i < NR; ++i) {
      Vec wv = load_f32<WT>(wrows[i] + c);
      SPARSEVER_UNROLL
      for (int t = 0; t < NT; ++t) acc[i][t] = at::vec::fmadd(wv, xv[t], acc[i][t]);
    }
  }
  SPARSEVER_UNROLL
  for (int i = 0; i < NR; ++i)
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) {
      float v = hsum(acc[i][t]);
      for (int64_t cc = c; cc < h; ++cc) v += static_cast<float>(wrows[i][cc]) * x[t * h + cc];
      y[t * y_stride + i] = v;
    }
}

// fn(std::integral_constant<int, NT>, t) for token tiles [t, t + NT) covering [0, num_tokens): tiles of 4,
// then one of 3, 2 or 1 (NT is a compile-time register-tile size for the kernels).
template <typename Fn>
inline void for_each_token_tile(int64_t num_tokens, Fn&& fn) {
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4) fn(std::integral_constant<int, 4>{}, t);
  switch (num_tokens - t) {
    case 3: fn(std::integral_constant<int, 3>{}, t); break;
    case 2: fn(std::integral_constant<int, 2>{}, t); break;
    case 1: fn(std::integral_constant<int, 1>{}, t); break;
    default: break;
  }
}

// The row-tile walk of every row-dot kernel (fp32 FMAs below, vdpbf16ps in gemv_rows_bf16.cpp): output
// rows [row_begin, row_end) in tiles of up to 4 rows, row(j) = idx ? idx[j] : j;
// tile(std::integral_constant<int, NR>, rows, j0, next, nn) computes rows j0..j0+NR-1, with the next
// tile's nn rows to prefetch as it goes. Rows are short streams (1-3 KiB): the task's first tile is
// prefetched here, every later one while the tile before it computes.
template <typename T, typename Tile>
inline void for_each_row_tile(const T* w, int64_t w_row_stride, const int32_t* idx, int64_t h, int64_t row_begin,
                              int64_t row_end, Tile&& tile) {
  constexpr int kRowTile = 4;
  const int64_t row_bytes = h * static_cast<int64_t>(sizeof(T));
  auto row = [&](int64_t j) { return w + (idx ? idx[j] : j) * w_row_stride; };
  for (int64_t j0 = row_begin; j0 < row_end; j0 += kRowTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowTile, row_end - j0));
    const int nn = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kRowTile, row_end - j0 - kRowTile)));
    const T* rows[kRowTile];
    const T* next[kRowTile];
    for (int i = 0; i < nr; ++i) rows[i] = row(j0 + i);
    for (int i = 0; i < nn; ++i) next[i] = row(j0 + kRowTile + i);
    if (j0 == row_begin)
      for (int i = 0; i < nr; ++i)
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + b, _MM_HINT_T0);
    switch (nr) {
      case 4: tile(std::integral_constant<int, 4>{}, rows, j0, next, nn); break;
      case 3: tile(std::integral_constant<int, 3>{}, rows, j0, next, nn); break;
      case 2: tile(std::integral_constant<int, 2>{}, rows, j0, next, nn); break;
      default: tile(std::integral_constant<int, 1>{}, rows, j0, next, nn); break;
    }
  }
}

// Serial: output rows [row_begin, row_end) of rows_dot (row_begin a multiple of 4 except at the end).
template <typename WT>
void rows_dot_range(const float* x, int64_t num_tokens, int64_t h, const WT* w, int64_t w_row_stride,
                    const int32_t* idx, int64_t row_begin, int64_t row_end, float* y, int64_t y_stride) {
  for_each_row_tile(w, w_row_stride, idx, h, row_begin, row_end,
                    [&](auto nr, const WT* const* rows, int64_t j0, const WT* const* next, int nn) {
                      // Only the first token tile prefetches; later ones re-read this tile from cache.
                      for_each_token_tile(num_tokens, [&](auto nt, int64_t t) {
                        dot_tile<decltype(nr)::value, decltype(nt)::value, WT>(
                            x + t * h, h, rows, y + t * y_stride + j0, y_stride, next, t == 0 ? nn : 0);
                      });
                    });
}

// Rows per parallel task: ~64 KiB of weights, so small matrices are not split into tiny tasks.
inline int64_t rows_per_task(int64_t h, int64_t elem_size) {
  return std::max<int64_t>(4, (65536 / std::max<int64_t>(1, h * elem_size)) / 4 * 4);
}

// range(r0, r1) over output rows [0, nrows) in parallel tasks of rows_per_task(h, elem_size) rows.
template <typename Range>
inline void parallel_row_tasks(int64_t nrows, int64_t h, int64_t elem_size, Range&& range) {
  const int64_t chunk = rows_per_task(h, elem_size);
  at::parallel_for(0, (nrows + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    range(begin * chunk, std::min(nrows, end * chunk));
  });
}

// Y[t, j] = X[t, :] . W[row(j), :]: parallel over output rows (weight rows). Y [T, nrows], row stride y_stride.
template <typename WT>
void rows_dot(const float* x, int64_t num_tokens, int64_t h, const WT* w, int64_t w_row_stride,
              const int32_t* idx, int64_t nrows, float* y, int64_t y_stride) {
  if (num_tokens == 0 || nrows == 0) return;
  parallel_row_tasks(nrows, h, sizeof(WT), [&](int64_t r0, int64_t r1) {
    rows_dot_range<WT>(x, num_tokens, h, w, w_row_stride, idx, r0, r1, y, y_stride);
  });
}

// Prefetch columns [c0, c1) of rows row(j), j in [j0, j1): the next row block of rows_axpy.
template <typename WT>
inline void prefetch_rows(const WT* w, int64_t w_row_stride, const int32_t* idx, int64_t j0, int64_t j1,
                          int64_t c0, int64_t c1) {
  for (int64_t j = j0; j < j1; ++j) {
    const char* p = reinterpret_cast<const char*>(w + (idx ? idx[j] : j) * w_row_stride + c0);
    const int64_t bytes = (c1 - c0) * static_cast<int64_t>(sizeof(WT));
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

// One (token tile x column chunk) of rows_axpy over rows [j0, j1): NT tokens, NV vectors at column c0.
template <int NT, int NV, typename WT>
inline void axpy_tile(const float* a, int64_t k, const WT* w, int64_t w_row_stride, const int32_t* idx,
                      int64_t j0, int64_t j1, bool accumulate, int64_t c0, float* out, int64_t h) {
  Vec acc[NT][NV];
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t)
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) acc[t][v] = accumulate ? Vec::loadu(out + t * h + c0 + v * kVecLen) : Vec(0.f);
  for (int64_t j = j0; j < j1; ++j) {
    const WT* wr = w + (idx ? idx[j] : j) * w_row_stride + c0;
    Vec wv[NV];
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) wv[v] = load_f32<WT>(wr + v * kVecLen);
    SPARSEVER_UNROLL
    for (int t = 0; t < NT; ++t) {
      Vec sv(a[t * k + j]);
      SPARSEVER_UNROLL
      for (int v = 0; v < NV; ++v) acc[t][v] = at::vec::fmadd(sv, wv[v], acc[t][v]);
    }
  }
  SPARSEVER_UNROLL
  for (int t = 0; t < NT; ++t)
    SPARSEVER_UNROLL
    for (int v = 0; v < NV; ++v) acc[t][v].store(out + t * h + c0 + v * kVecLen);
}

template <int NV, typename WT>
inline void axpy_chunk(const float* a, int64_t num_tokens, int64_t k, const WT* w, int64_t w_row_stride,
                       const int32_t* idx, int64_t j0, int64_t j1, bool accumulate, int64_t c0, float* out,
                       int64_t h) {
  for_each_token_tile(num_tokens, [&](auto nt, int64_t t) {
    axpy_tile<decltype(nt)::value, NV, WT>(a + t * k, k, w, w_row_stride, idx, j0, j1, accumulate, c0, out + t * h, h);
  });
}

// Rows [jb, je) of rows_axpy over every full-vector column into out (row stride h, overwritten), in
// blocks of kRowBlock rows walked along the row; the next block's columns are prefetched a chunk at a time.
template <typename WT>
void axpy_rows(const float* a, int64_t num_tokens, int64_t k, const WT* w, int64_t w_row_stride, const int32_t* idx,
               int64_t jb, int64_t je, int64_t h, float* out) {
  constexpr int kCols = 4;  // vectors per column chunk (token tile x kCols accumulators)
  constexpr int64_t kRowBlock = 8;
  const int64_t full_vecs = h / kVecLen;
  const int64_t chunks = (full_vecs + kCols - 1) / kCols, cols = full_vecs * kVecLen;
  prefetch_rows<WT>(w, w_row_stride, idx, jb, std::min(je, jb + kRowBlock), 0, cols);
  for (int64_t j0 = jb; j0 < je; j0 += kRowBlock) {
    const int64_t j1 = std::min(je, j0 + kRowBlock);
    const int64_t jn1 = std::min(je, j1 + kRowBlock);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t c0 = ch * kCols * kVecLen;
      // This chunk's columns of the next row block, spread over the chunks (see dot_tile).
      prefetch_rows<WT>(w, w_row_stride, idx, j1, jn1, c0, std::min(cols, c0 + kCols * kVecLen));
      const bool acc = j0 > jb;
      switch (std::min<int64_t>(kCols, full_vecs - ch * kCols)) {
        case 4: axpy_chunk<4, WT>(a, num_tokens, k, w, w_row_stride, idx, j0, j1, acc, c0, out, h); break;
        case 3: axpy_chunk<3, WT>(a, num_tokens, k, w, w_row_stride, idx, j0, j1, acc, c0, out, h); break;
        case 2: axpy_chunk<2, WT>(a, num_tokens, k, w, w_row_stride, idx, j0, j1, acc, c0, out, h); break;
        default: axpy_chunk<1, WT>(a, num_tokens, k, w, w_row_stride, idx, j0, j1, acc, c0, out, h); break;
      }
    }
  }
}

// sum[0, size) = the sum over shares of [0, n) of work(begin, end, buf), where work writes a share's
// partial sums into buf (size floats, overwritten). One share per thread, at least min_per_share units
// each; share 0 writes sum itself, the others a buffer added once at the end. The down projections
// use it so that each thread streams its share of the selected rows start to end.
template <typename Work>
inline void sum_over_row_shares(int64_t n, int64_t min_per_share, int64_t size, float* sum, Work&& work) {
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / min_per_share));
  const int64_t per_share = (n + shares - 1) / shares;
  std::vector<float> partial(static_cast<size_t>((shares - 1) * size));
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t b = s * per_share, e = std::min(n, b + per_share);
      float* buf = s == 0 ? sum : partial.data() + (s - 1) * size;
      if (b < e)
        work(b, e, buf);
      else
        std::fill(buf, buf + size, 0.f);
    }
  });
  for (int64_t s = 1; s < shares; ++s)
    for (int64_t i = 0; i < size; ++i) sum[i] += partial[(s - 1) * size + i];
}

// OUT[t, :] = sum_j A[t, j] * W[row(j), :]  (A [T, K] fp32, OUT [T, H] fp32 contiguous, overwritten).
// Each thread streams a share of the selected rows start to end into its own partial sums of every
// column (sum_over_row_shares). (A column slab of every row per thread was slower at 1-8 tokens;
// docs/kernels.md, 2026-11-25.)
template <typename WT>
void rows_axpy(const float* a, int64_t num_tokens, int64_t k, const WT* w, int64_t w_row_stride,
               const int32_t* idx, int64_t h, float* out) {
  constexpr int64_t kMinRowsPerShare = 16;
  if (num_tokens == 0) return;
  if (k == 0) {
    std::fill(out, out + num_tokens * h, 0.f);
    return;
  }
  sum_over_row_shares(k, kMinRowsPerShare, num_tokens * h, out, [&](int64_t jb, int64_t je, float* buf) {
    axpy_rows<WT>(a, num_tokens, k, w, w_row_stride, idx, jb, je, h, buf);
  });
  // Columns past the last full vector (H not a multiple of the vector width): scalar.
  for (int64_t c = h / kVecLen * kVecLen; c < h; ++c)
    for (int64_t t = 0; t < num_tokens; ++t) {
      float v = 0.f;
      for (int64_t j = 0; j < k; ++j) v += a[t * k + j] * static_cast<float>(w[(idx ? idx[j] : j) * w_row_stride + c]);
      out[t * h + c] = v;
    }
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

inline Vec silu(const Vec& v) { return v / (Vec(1.f) + v.neg().exp_u20()); }

// In place a[i] = silu(a[i]) for n values (vectorised: scalar exp would dominate at 64 tokens).
inline void silu_inplace(float* a, int64_t n) {
  int64_t i = 0;
  for (; i + kVecLen <= n; i += kVecLen) silu(Vec::loadu(a + i)).store(a + i);
  for (; i < n; ++i) a[i] = silu(a[i]);
}

// out[i] = silu(g[i]) * u[i] for n values.
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kVecLen <= n; i += kVecLen) (silu(Vec::loadu(g + i)) * Vec::loadu(u + i)).store(out + i);
  for (; i < n; ++i) out[i] = silu(g[i]) * u[i];
}

}  // namespace sparsever::cpu
