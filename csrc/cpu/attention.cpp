// Block-sparse tree attention over the paged KV cache (CPU).
//
// Work is split per (request, KV head) into items, each a run of "segments" (a logical block and a
// token range in it): the selected context blocks (split-K into chunks for long contexts) and, last,
// the request's own query tokens under the tree/causal mask. Each item runs an online softmax for all
// rows (query token x query head of the GQA group) at once, so a selected block is read ONCE for every
// draft token and every head sharing its KV head. Partial results (m, l, acc) are merged at the end.
//
// Layouts: K is consumed as [D, tokens] (stride 1 along tokens), which is exactly vLLM-CPU's stored
// layout, so the score microkernel broadcasts q_d and streams K rows with FMAs; V is consumed
// row-major [tokens, D]. Any other strides (e.g. GPU's row-major K) or head_dim not a multiple of the
// vector width are packed into fp32 scratch first. Only the selected blocks' bytes are read.
//
// vLLM-CPU's AMX layout (bf16 caches on CPUs with AMX) is read as is, through 6-D views that name it
// (`paged_kv_views`): per block and KV head
//   K [bs/16 token groups][D/2 dim pairs][16 tokens][2]   each token group: an AMX B operand of Q K^T
//   V [D/16 dim groups][bs/2 token pairs][16 dims][2]      each dim group: an AMX B operand of P V
// There the scores and P V run as AMX tile products (bf16 in, fp32 out) for up to 32 rows per pass,
// and the online softmax stays in fp32 vectors. The tile steps are templates over amx_tiles.h's
// backends: the instructions, or (SPARSEVER_CPU_AMX_EMULATE=1, tests) their software model.
//
// bf16 on the plain layout, on a CPU with AVX512-BF16 (no AMX needed): each segment's K and V are first
// interleaved into pairs along the reduction axis (K by dim pairs, V by token pairs), once for all the
// item's rows, and both products run as vdpbf16ps (32 bf16 multiply-adds per instruction) from
// register tiles of 4 rows; P is rounded to bf16 as on the AMX path. By default only on CPUs without
// AMX (AMD Zen 4/5), where one vdpbf16ps does twice the multiply-adds of an fp32 FMA; on Intel CPUs it
// does the same number and measured slower than the FMA path (bench/results/README.md, "attention
// bf16 dot"). SPARSEVER_CPU_ATTN_BF16_DOT=1 / =0 forces it on / off.
#include "amx_tiles.h"
#include "cpu_utils.h"
#include "gemv_rows_bf16.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

namespace sparsever::cpu {
namespace {

// Query rows per register tile: ROWS x 2 vectors of accumulators plus the K/V vectors and a broadcast
// must fit the vector registers (16 with AVX2, 32 with AVX-512).
constexpr int kRowTile = kVecLen == 8 ? 6 : 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Segment {
  int32_t block;  // logical block index in the request's block table
  int32_t t_lo;   // first token offset inside the block
  int32_t t_hi;   // one past the last token offset
  bool is_query;  // tokens are the request's own query tokens (masked), else context
};

struct WorkItem {
  int32_t req, head;
  int32_t seg_begin, seg_end;  // range in the (req, head)'s segment list
  int64_t partial_offset;      // where this item's [rows] m, [rows] l, [rows, Dp] acc live
};

// Query-token columns [c_lo, c_hi) of one score row: column c holds the request's query token j0 + c,
// which the row's token i may attend by its tree-mask row (or causally, without a mask).
inline void mask_query_columns(float* srow, int c_lo, int c_hi, int j0, int i, const uint8_t* mask_row) {
  for (int c = c_lo; c < c_hi; ++c) {
    const int j = j0 + c;
    if (!(mask_row != nullptr ? mask_row[j] != 0 : j <= i)) srow[c] = kNegInf;
  }
}

// The online softmax of one row, in three steps shared by the vec and AMX paths: the new running max,
// P = exp(scale * s - m) (each path stores P its own way: fp32 in place, or bf16 for the tile products),
// then the running sum and the accumulator's rescale. A row with nothing allowed so far keeps m = -inf
// and gets P = 0.
inline float softmax_row_max(const float* srow, int ntp, float scale, float m) {
  Vec vmax(kNegInf);
  for (int t = 0; t < ntp; t += kVecLen) vmax = at::vec::maximum(vmax, Vec::loadu(srow + t));
  const float seg_max =
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  return std::max(m, seg_max * scale);  // scale > 0 keeps the max's place
}

// The running max and sum for a new max; returns the factor the row's accumulator must be scaled by.
inline float softmax_row_state(float& m, float& l, float m_new, const Vec& vsum) {
  const float alpha = std::exp(m - m_new);  // exp(-inf) = 0 on the first segment
  l = l * alpha + hsum(vsum);
  m = m_new;
  return alpha;
}

inline void scale_row(float* acc, int d, float alpha) {
  if (alpha == 1.f) return;
  const Vec va(alpha);
  for (int c = 0; c < d; c += kVecLen) (Vec::loadu(acc + c) * va).store(acc + c);
}

inline void softmax_row_update(float& m, float& l, float m_new, const Vec& vsum, float* acc, int d) {
  scale_row(acc, d, softmax_row_state(m, l, m_new, vsum));
}

// The vec path's row: scores already scaled (q was), P written over them in fp32.
inline void online_softmax_row(float* srow, int ntp, float& m, float& l, float* acc, int d) {
  const float m_new = softmax_row_max(srow, ntp, 1.f, m);
  if (m_new == kNegInf) {
    std::fill(srow, srow + ntp, 0.f);
    return;
  }
  Vec vsum(0.f), vm(m_new);
  for (int t = 0; t < ntp; t += kVecLen) {
    Vec e = (Vec::loadu(srow + t) - vm).exp_u20();
    e.store(srow + t);
    vsum = vsum + e;
  }
  softmax_row_update(m, l, m_new, vsum, acc, d);
}

// S[r, t] = sum_d Q[r, d] * K[d, t] for ROWS rows and ntp tokens (multiple of kVecLen).
template <int ROWS, typename KT>
inline void qk_tile(const float* q, int64_t q_stride, const KT* k, int64_t k_stride_d, int dp, int ntp,
                    float* s, int64_t s_stride) {
  int t = 0;
  for (; t + 2 * kVecLen <= ntp; t += 2 * kVecLen) {
    Vec acc0[ROWS], acc1[ROWS];
    SPARSEVER_UNROLL
    for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = Vec(0.f);
    for (int d = 0; d < dp; ++d) {
      const KT* kd = k + d * k_stride_d + t;
      Vec k0 = load_f32<KT>(kd), k1 = load_f32<KT>(kd + kVecLen);
      SPARSEVER_UNROLL
      for (int r = 0; r < ROWS; ++r) {
        Vec qv(q[r * q_stride + d]);
        acc0[r] = at::vec::fmadd(qv, k0, acc0[r]);
        acc1[r] = at::vec::fmadd(qv, k1, acc1[r]);
      }
    }
    SPARSEVER_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      acc0[r].store(s + r * s_stride + t);
      acc1[r].store(s + r * s_stride + t + kVecLen);
    }
  }
  for (; t < ntp; t += kVecLen) {
    Vec acc0[ROWS];
    for (int r = 0; r < ROWS; ++r) acc0[r] = Vec(0.f);
    for (int d = 0; d < dp; ++d) {
      Vec k0 = load_f32<KT>(k + d * k_stride_d + t);
      for (int r = 0; r < ROWS; ++r) acc0[r] = at::vec::fmadd(Vec(q[r * q_stride + d]), k0, acc0[r]);
    }
    for (int r = 0; r < ROWS; ++r) acc0[r].store(s + r * s_stride + t);
  }
}

// acc[r, :] += sum_t P[r, t] * V[t, :] for ROWS rows, dp (multiple of kVecLen) columns.
template <int ROWS, typename VT>
inline void pv_tile(const float* p, int64_t p_stride, const VT* v, int64_t v_stride_t, int ntok, int dp,
                    float* acc, int64_t acc_stride) {
  constexpr int kCols = kVecLen == 8 ? 2 : 4;  // vectors of D per tile: ROWS*kCols accumulators
  int c = 0;
  for (; c + kCols * kVecLen <= dp; c += kCols * kVecLen) {
    Vec a[ROWS][kCols];
    SPARSEVER_UNROLL
    for (int r = 0; r < ROWS; ++r)
      SPARSEVER_UNROLL
      for (int j = 0; j < kCols; ++j) a[r][j] = Vec::loadu(acc + r * acc_stride + c + j * kVecLen);
    for (int t = 0; t < ntok; ++t) {
      const VT* vt = v + t * v_stride_t + c;
      Vec vv[kCols];
      SPARSEVER_UNROLL
      for (int j = 0; j < kCols; ++j) vv[j] = load_f32<VT>(vt + j * kVecLen);
      SPARSEVER_UNROLL
      for (int r = 0; r < ROWS; ++r) {
        Vec pv(p[r * p_stride + t]);
        SPARSEVER_UNROLL
        for (int j = 0; j < kCols; ++j) a[r][j] = at::vec::fmadd(pv, vv[j], a[r][j]);
      }
    }
    SPARSEVER_UNROLL
    for (int r = 0; r < ROWS; ++r)
      SPARSEVER_UNROLL
      for (int j = 0; j < kCols; ++j) a[r][j].store(acc + r * acc_stride + c + j * kVecLen);
  }
  for (; c < dp; c += kVecLen) {
    Vec a[ROWS];
    for (int r = 0; r < ROWS; ++r) a[r] = Vec::loadu(acc + r * acc_stride + c);
    for (int t = 0; t < ntok; ++t) {
      Vec vv = load_f32<VT>(v + t * v_stride_t + c);
      for (int r = 0; r < ROWS; ++r) a[r] = at::vec::fmadd(Vec(p[r * p_stride + t]), vv, a[r]);
    }
    for (int r = 0; r < ROWS; ++r) a[r].store(acc + r * acc_stride + c);
  }
}

template <typename KT>
void qk_rows(const float* q, int rows, int dp, const KT* k, int64_t k_stride_d, int ntp, float* s,
             int64_t s_stride) {
  int r = 0;
  for (; r + kRowTile <= rows; r += kRowTile)
    qk_tile<kRowTile, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride);
  switch (rows - r) {
    case 5: qk_tile<5, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride); break;
    case 4: qk_tile<4, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride); break;
    case 3: qk_tile<3, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride); break;
    case 2: qk_tile<2, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride); break;
    case 1: qk_tile<1, KT>(q + r * dp, dp, k, k_stride_d, dp, ntp, s + r * s_stride, s_stride); break;
    default: break;
  }
}

template <typename VT>
void pv_rows(const float* p, int64_t p_stride, int rows, const VT* v, int64_t v_stride_t, int ntok, int dp,
             float* acc) {
  int r = 0;
  for (; r + kRowTile <= rows; r += kRowTile)
    pv_tile<kRowTile, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp);
  switch (rows - r) {
    case 5: pv_tile<5, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp); break;
    case 4: pv_tile<4, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp); break;
    case 3: pv_tile<3, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp); break;
    case 2: pv_tile<2, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp); break;
    case 1: pv_tile<1, VT>(p + r * p_stride, p_stride, v, v_stride_t, ntok, dp, acc + r * dp, dp); break;
    default: break;
  }
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Prefetch (into L2) `rows` runs of `row_len` contiguous elements, `row_stride` apart.
template <typename T>
inline void prefetch_2d(const T* base, int64_t rows, int64_t row_stride, int64_t row_len) {
  const int64_t bytes = row_len * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(base + r * row_stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}

// One line of every 4 KiB page of a contiguous range, into L2: each starts the L2 streamer on that page,
// which then fetches the rest. Every line of a block prefetched in one burst (prefetch_2d) costs more
// core time than it saves on the AMX layout, where a block and head is 2 x bs*D contiguous bf16
// (bench/results/kernels_attention_ab_2026-12-01_*).
template <typename T>
inline void prefetch_pages(const T* base, int64_t n) {
  const char* p = reinterpret_cast<const char*>(base);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 4096) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Rows (query tokens x GQA group) of a request from which bf16/fp16 attention uses ATen's SDPA on the
// gathered selected tokens; SPARSEVER_CPU_ATTN_SDPA_MIN_ROWS overrides it (0 disables the path).
inline int64_t sdpa_min_rows() {
  static const int64_t value = [] {
    const char* env = std::getenv("SPARSEVER_CPU_ATTN_SDPA_MIN_ROWS");
    const int64_t v = env ? std::atoll(env) : int64_t{128};
    return v <= 0 ? std::numeric_limits<int64_t>::max() : v;
  }();
  return value;
}

// How the AMX pipeline fetches the blocks ahead (SPARSEVER_CPU_AMX_PREFETCH, read per op call):
//   pages   one line of every 4 KiB page of the next segment's block, at its first unit (prefetch_pages);
//   stream  every line of the blocks the next iteration reads first, a few per tile step of this one
//           (PrefetchStream, as the vdpbf16ps path does).
enum class AmxPrefetch { kPages, kStream };

inline AmxPrefetch amx_prefetch_from_env() {
  const char* env = std::getenv("SPARSEVER_CPU_AMX_PREFETCH");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "pages") == 0) return AmxPrefetch::kPages;
  TORCH_CHECK(std::strcmp(env, "stream") == 0, "SPARSEVER_CPU_AMX_PREFETCH=", env,
              ": allowed values are 'pages' (the default) and 'stream'");
  return AmxPrefetch::kStream;
}

#if defined(CPU_CAPABILITY_AVX512)
using bf16 = c10::BFloat16;

// Buffers of one thread for the bf16 paths (AMX tiles, vdpbf16ps).
struct Bf16Scratch {
  std::vector<bf16> q, p, k, v;
  std::vector<float> s;
};

// Rows [0, rows) of one (request, KV head) over one segment of tokens [t_lo, t_hi) of a block: the
// segment functions update the online softmax state m/l and acc [rows, d]. q: bf16 [rows, d] (unscaled).
struct BlockSegment {
  const bf16* k_block;  // the block's K for this head (AMX layout, or K^T rows k_stride_d apart)
  const bf16* v_block;  // the block's V (AMX layout, or rows v_stride_t apart)
  int64_t k_stride_d, v_stride_t;  // plain layout only
  int bs, d, t_lo, t_hi;
  bool is_query;
  int block, ctx_len, t0, group;  // for the query tokens' mask
  const uint8_t* mask;
  int64_t mask_stride;
};

constexpr float kLog2e = 1.4426950408889634f;

// 2^x for the softmax's probabilities (x <= 0; -inf for masked tokens gives 0): 2^round(x) by
// vscalefps times a degree-4 polynomial for 2^f, f in [-1/2, 1/2] (relative error 2.7e-6, about that of
// ATen's exp_u20, in half its instructions: the softmax's vector work bounds these kernels on AMX).
// Below 2^-126 (a normal float's least exponent) P is 0.
SPARSEVER_AVX512_BF16 inline __m512 exp2_probability(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.009570099413394928f), _mm512_set1_ps(0.05591785907745361f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240247443318367f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931217908859253f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

struct NoHook {
  void operator()() const {}
};

// Scores s [rows, ntp] (unscaled; tokens a_lo .. a_lo + ntp of the block, ntp a multiple of 32) of the
// item's rows row0 .. row0 + rows -> masks, the online softmax step, and P rounded to bf16
// (vcvtne2ps2bf16) into p [rows, ntp]; m, l and acc point at row row0's state. With `alpha`, the
// accumulators' rescale factors are written there instead of applied (the AMX pipeline applies them
// once the P V in flight over those rows is done); `after_row` runs after each row (the pipeline's
// tile steps, interleaved with this vector work).
template <typename AfterRow = NoHook>
SPARSEVER_AVX512_BF16 inline void softmax_rows_to_bf16(const BlockSegment& sg, int a_lo, int ntp, int row0, int rows,
                                                       float scale, float* s, bf16* p, float* m, float* l,
                                                       float* acc, float* alpha = nullptr,
                                                       AfterRow&& after_row = AfterRow{}) {
  const int d = sg.d;
  for (int row = 0; row < rows; ++row, after_row()) {
    float* srow = s + static_cast<int64_t>(row) * ntp;  // unscaled
    for (int t = 0; t < sg.t_lo - a_lo; ++t) srow[t] = kNegInf;
    for (int t = sg.t_hi - a_lo; t < ntp; ++t) srow[t] = kNegInf;
    if (sg.is_query) {
      const int i = (row0 + row) / sg.group;
      mask_query_columns(srow, sg.t_lo - a_lo, sg.t_hi - a_lo, sg.block * sg.bs + a_lo - sg.ctx_len, i,
                         sg.mask ? sg.mask + (sg.t0 + i) * sg.mask_stride : nullptr);
    }
    // The row's softmax step with P rounded to bf16 by vcvtne2ps2bf16 (ntp is a multiple of 32).
    bf16* prow = p + static_cast<int64_t>(row) * ntp;
    const float m_new = softmax_row_max(srow, ntp, scale, m[row]);
    if (m_new == kNegInf) {
      std::memset(static_cast<void*>(prow), 0, static_cast<size_t>(ntp) * sizeof(bf16));
      if (alpha != nullptr) alpha[row] = 1.f;
      continue;
    }
    // exp(scale * s - m) = 2^(s * scale log2 e - m log2 e): one FMA, then exp2_probability.
    const __m512 vscale = _mm512_set1_ps(scale * kLog2e), vneg_m = _mm512_set1_ps(-m_new * kLog2e);
    __m512 vsum0 = _mm512_setzero_ps(), vsum1 = _mm512_setzero_ps();
    for (int t = 0; t < ntp; t += 2 * kVecLen) {
      const __m512 e0 = exp2_probability(_mm512_fmadd_ps(_mm512_loadu_ps(srow + t), vscale, vneg_m));
      const __m512 e1 = exp2_probability(_mm512_fmadd_ps(_mm512_loadu_ps(srow + t + kVecLen), vscale, vneg_m));
      vsum0 = _mm512_add_ps(vsum0, e0);
      vsum1 = _mm512_add_ps(vsum1, e1);
      _mm512_storeu_si512(prow + t, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // e0 -> low half
    }
    const Vec vsum(_mm512_add_ps(vsum0, vsum1));
    if (alpha != nullptr) {
      alpha[row] = softmax_row_state(m[row], l[row], m_new, vsum);
    } else {
      softmax_row_update(m[row], l[row], m_new, vsum, acc + static_cast<int64_t>(row) * d, d);
    }
  }
}

// A software prefetch into L2 (PrefetchStream's default issuer).
struct CorePrefetch {
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};

// The next block's K and V lines, prefetched a few per step of the current block's dot products (or
// tile steps): at the rate DRAM delivers them, instead of a burst that stalls the core on full miss
// buffers. Each of K and V is n_rows runs of contiguous elements; one left empty is skipped.
struct PrefetchStream {
  const char* base[2] = {nullptr, nullptr};  // K, V
  int64_t stride[2] = {0, 0}, lines_per_row[2] = {1, 1}, total[2] = {0, 0};
  int64_t next = 0;
  int per_step = 1;
  void add(int i, const bf16* p, int64_t n_rows, int64_t n_row_elems, int64_t stride_elems) {
    base[i] = reinterpret_cast<const char*>(p);
    stride[i] = stride_elems * static_cast<int64_t>(sizeof(bf16));
    lines_per_row[i] = (n_row_elems * static_cast<int64_t>(sizeof(bf16)) + 63) / 64;
    total[i] = n_rows * lines_per_row[i];
  }
  // Issue: a type with a static prefetch(const void*) (an amx_tiles.h backend, to follow the AMX
  // path's prefetches on the emulated tiles).
  template <typename Issue = CorePrefetch>
  inline void step() {
    for (int k = 0; k < per_step; ++k, ++next) {
      int64_t idx = next;
      const int which = idx < total[0] ? 0 : 1;
      if (which == 1) idx -= total[0];
      if (idx >= total[which]) return;
      const int64_t row = idx / lines_per_row[which], off = (idx % lines_per_row[which]) * 64;
      Issue::prefetch(base[which] + row * stride[which] + off);
    }
  }
};

// ---- the AMX layout: a pipeline of tile products under the softmax's vector work ----
//
// An item's work is cut into units, one 32-row group (two tile row groups of m0 and m1 rows) of one
// segment each, run in order. Each unit's Q K^T and P V are sequences of tile steps (a 32-dim slice of a
// pair of token groups; a 32-token chunk of a pair of 16-dim output slices), and the steps of P V(u - 1)
// and Q K^T(u + 1) are interleaved with unit u's softmax rows, so the tile unit and the vector units
// work at once. Scores and P are double-buffered; the softmax's rescale of acc is deferred until the
// P V in flight over the same rows is done.

struct AmxUnit {
  const BlockSegment* sg;
  int a_lo, ntp;   // the 32-aligned token range of the segment's block
  int r0, m0, m1;  // rows r0 .. r0 + m0 + m1 of the item (r0 == 0: the segment's first unit)
};

// S [m0 + m1 rows, ntp] = Q K^T of one unit, one step per 32-dim slice of a pair of 16-token groups.
template <typename Tiles>
struct AmxScoreSteps {
  const bf16* q = nullptr;  // the unit's first row
  const bf16* k = nullptr;  // the first token group of the unit's range (AMX K layout)
  float* s = nullptr;
  int d = 0, ntp = 0, m0 = 0, m1 = 0;
  int g = 0, c = 0, n_groups = 0;  // progress: token group pair g, dims [c, c + 32)

  int total() const { return n_groups / 2 * (d / amx::kBf16PerRow); }
  bool done() const { return g >= n_groups; }
  SPARSEVER_AMX void step(amx::TileState<Tiles>& tiles) {
    if (c == 0) {
      tiles.configure(m0, m1);
      amx::zero_c_tiles<Tiles>(m1 > 0);
    }
    // The B tiles of dims [c, c + 32): dim pairs c/2 .. c/2 + 15, 16 tokens x 2 each.
    const bf16* k0 = k + g * 16 * static_cast<int64_t>(d) + c * 16;
    amx::dp_2x2<Tiles>(q + c, 2 * static_cast<int64_t>(d), m1 > 0, k0, k0 + 16 * static_cast<int64_t>(d));
    c += amx::kBf16PerRow;
    if (c >= d) {
      amx::store_c_tiles<Tiles>(s + g * 16, 4 * static_cast<int64_t>(ntp), m1 > 0);
      c = 0;
      g += 2;
    }
  }
};

// acc [m0 + m1 rows, d] += P V of one unit, one step per 32-token chunk of a pair of 16-dim slices.
template <typename Tiles>
struct AmxPvSteps {
  const bf16* p = nullptr;  // P [rows, ntp] bf16
  const bf16* v = nullptr;  // the first token pair of dim group 0 (AMX V layout), dim groups v_group apart
  int64_t v_group = 0;
  float* acc = nullptr;  // the unit's first row, rows d apart
  int d = 0, ntp = 0, m0 = 0, m1 = 0;
  int i = 0, k = 0;  // progress: dims [i, i + 32), chunk k

  int total() const { return d / (2 * amx::kF32PerRow) * (ntp / 32); }
  bool done() const { return i >= d; }
  SPARSEVER_AMX void step(amx::TileState<Tiles>& tiles) {
    float* c0 = acc + i;
    const int64_t ab = 4 * static_cast<int64_t>(d);
    if (k == 0) {
      tiles.configure(m0, m1);
      amx::load_c_tiles<Tiles>(c0, ab, m1 > 0);
    }
    const bf16* v0 = v + (i / 16) * v_group + k * 512;  // 16 token pairs x 16 dims x 2 per tile
    amx::dp_2x2<Tiles>(p + k * 32, 2 * static_cast<int64_t>(ntp), m1 > 0, v0, v0 + v_group);
    if (++k == ntp / 32) {
      amx::store_c_tiles<Tiles>(c0, ab, m1 > 0);
      k = 0;
      i += 2 * amx::kF32PerRow;
    }
  }
};

// Buffers of one thread for the AMX pipeline: double-buffered scores, P and rescale factors.
struct AmxPipelineBuffers {
  std::vector<float> s, alpha;
  std::vector<bf16> p, v;
  std::vector<AmxUnit> units;
  std::vector<BlockSegment> segments;  // of the item
};

// The units' token-range V: in place, or (a partial range) a copy with the tokens outside [t_lo, t_hi)
// zeroed: P is 0 there, but 0 x NaN from an unwritten slot is not.
inline const bf16* amx_unit_values(const AmxUnit& u, std::vector<bf16>& copy, int64_t& v_group) {
  const BlockSegment& sg = *u.sg;
  const int d = sg.d, ntp = u.ntp, a_lo = u.a_lo;
  const bf16* v = sg.v_block + static_cast<int64_t>(a_lo) * 16;
  v_group = static_cast<int64_t>(sg.bs) * 16;
  if (sg.t_lo == a_lo && sg.t_hi == a_lo + ntp) return v;
  const int64_t per_group = static_cast<int64_t>(ntp) * 16;
  if (copy.size() < static_cast<size_t>(d / 16) * per_group) copy.resize(static_cast<size_t>(d / 16) * per_group);
  for (int g = 0; g < d / 16; ++g) {
    const bf16* src = v + g * v_group;
    bf16* dst = copy.data() + g * per_group;
    for (int t = 0; t < ntp; ++t) {  // token t: pair t/2, element t%2 of each of the 16 dims
      const bool valid = a_lo + t >= sg.t_lo && a_lo + t < sg.t_hi;
      for (int dd = 0; dd < 16; ++dd) {
        const int64_t i = (t / 2) * 32 + dd * 2 + (t % 2);
        dst[i] = valid ? src[i] : bf16(0.f);
      }
    }
  }
  v_group = per_group;
  return copy.data();
}

// Rows [0, rows) of one (request, KV head) over the segments `sgs` (an item), on the AMX layout.
template <typename Tiles>
SPARSEVER_AMX void amx_item(const std::vector<BlockSegment>& sgs, const bf16* q, int rows, float scale, float* m,
                            float* l, float* acc, amx::TileState<Tiles>& tiles, AmxPipelineBuffers& buf,
                            AmxPrefetch prefetch) {
  if (sgs.empty()) return;
  const int d = sgs.front().d, bs = sgs.front().bs;
  auto& units = buf.units;
  units.clear();
  for (const BlockSegment& sg : sgs) {
    const int a_lo = sg.t_lo / 32 * 32, a_hi = (sg.t_hi + 31) / 32 * 32;
    for (int r = 0; r < rows; r += 32) {
      const int m0 = std::min(16, rows - r), m1 = std::max(0, std::min(16, rows - r - 16));
      units.push_back({&sg, a_lo, a_hi - a_lo, r, m0, m1});
    }
  }
  const int64_t slot = static_cast<int64_t>(32) * bs;  // one unit's scores / P (ntp <= bs)
  if (buf.s.size() < static_cast<size_t>(2 * slot)) buf.s.resize(static_cast<size_t>(2 * slot));
  if (buf.p.size() < static_cast<size_t>(2 * slot)) buf.p.resize(static_cast<size_t>(2 * slot));
  if (buf.alpha.size() < 64) buf.alpha.resize(64);
  const int n = static_cast<int>(units.size());
  auto scores_of = [&](int u) {
    const AmxUnit& un = units[u];
    if (prefetch == AmxPrefetch::kPages && un.r0 == 0) {  // the next segment's block, while this one is computed
      const size_t next = static_cast<size_t>(un.sg - sgs.data()) + 1;
      if (next < sgs.size()) {
        prefetch_pages(sgs[next].k_block, static_cast<int64_t>(bs) * d);
        prefetch_pages(sgs[next].v_block, static_cast<int64_t>(bs) * d);
      }
    }
    AmxScoreSteps<Tiles> st;
    st.q = q + static_cast<int64_t>(un.r0) * d;
    st.k = un.sg->k_block + static_cast<int64_t>(un.a_lo) * d;
    st.s = buf.s.data() + (u % 2) * slot;
    st.d = d;
    st.ntp = un.ntp;
    st.m0 = un.m0;
    st.m1 = un.m1;
    st.n_groups = un.ntp / 16;
    return st;
  };
  auto pv_of = [&](int u) {
    const AmxUnit& un = units[u];
    AmxPvSteps<Tiles> st;
    st.p = buf.p.data() + (u % 2) * slot;
    st.v = amx_unit_values(un, buf.v, st.v_group);
    st.acc = acc + static_cast<int64_t>(un.r0) * d;
    st.d = d;
    st.ntp = un.ntp;
    st.m0 = un.m0;
    st.m1 = un.m1;
    return st;
  };
  // Iteration u runs P V(u - 1) and Q K^T(u + 1), so iteration u + 1 first reads V of unit u and K of
  // unit u + 2: new blocks where that unit is its segment's first. `stream` spreads their lines over
  // iteration u's `steps` tile steps (u = -1: the first unit's Q K^T).
  auto stream_ahead = [&](int u, int steps) {
    PrefetchStream pf;
    pf.per_step = 0;
    if (prefetch != AmxPrefetch::kStream || steps == 0) return pf;
    if (u + 2 < n && units[u + 2].r0 == 0) {  // K [token groups][D/2][16][2]: the range is contiguous
      const AmxUnit& un = units[u + 2];
      pf.add(0, un.sg->k_block + static_cast<int64_t>(un.a_lo) * d, 1, static_cast<int64_t>(un.ntp) * d, 0);
    }
    if (u >= 0 && units[u].r0 == 0) {  // V [D/16][bs/2][16][2]: one run per dim group, bs * 16 apart
      const AmxUnit& un = units[u];
      pf.add(1, un.sg->v_block + static_cast<int64_t>(un.a_lo) * 16, d / 16, static_cast<int64_t>(un.ntp) * 16,
             static_cast<int64_t>(bs) * 16);
    }
    pf.per_step = static_cast<int>((pf.total[0] + pf.total[1] + steps - 1) / steps);
    return pf;
  };
  {
    AmxScoreSteps<Tiles> first = scores_of(0);
    PrefetchStream pf = stream_ahead(-1, first.total());
    while (!first.done()) {
      first.step(tiles);
      pf.step<Tiles>();
    }
  }
  for (int u = 0; u < n; ++u) {
    const AmxUnit& un = units[u];
    const int un_rows = un.m0 + un.m1;
    AmxPvSteps<Tiles> pv;  // P V of the unit before, then Q K^T of the unit after, under this unit's softmax
    AmxScoreSteps<Tiles> next;
    if (u > 0) pv = pv_of(u - 1);
    if (u + 1 < n) next = scores_of(u + 1);
    const int steps = (u > 0 ? pv.total() : 0) + (u + 1 < n ? next.total() : 0);
    const int per_row = (steps + un_rows - 1) / un_rows;
    PrefetchStream pf = stream_ahead(u, steps);
    auto run = [&](int count) {
      for (; count > 0; --count) {
        if (!pv.done()) {
          pv.step(tiles);
        } else if (!next.done()) {
          next.step(tiles);
        } else {
          return;
        }
        pf.step<Tiles>();
      }
    };
    float* alpha = buf.alpha.data() + (u % 2) * 32;
    softmax_rows_to_bf16(*un.sg, un.a_lo, un.ntp, un.r0, un_rows, scale, buf.s.data() + (u % 2) * slot,
                         buf.p.data() + (u % 2) * slot, m + un.r0, l + un.r0, acc + static_cast<int64_t>(un.r0) * d,
                         alpha, [&] { run(per_row); });
    run(std::numeric_limits<int>::max());
    // P V(u - 1) is done: the rows' rescale for this unit's new maxima can be applied before P V(u).
    for (int r = 0; r < un_rows; ++r) scale_row(acc + static_cast<int64_t>(un.r0 + r) * d, d, alpha[r]);
  }
  AmxPvSteps<Tiles> last = pv_of(n - 1);
  while (!last.done()) last.step(tiles);
}

// ---- vdpbf16ps on the plain layout ----

// Read once per call (see the top of the file for the default).
inline bool use_attention_bf16_dot() {
  if (!rows_bf16_available()) return false;
  const char* env = std::getenv("SPARSEVER_CPU_ATTN_BF16_DOT");
  if (env != nullptr && *env != '\0') return std::strcmp(env, "0") != 0;
  return !amx::amx_usable();
}

// permutex2var indices that interleave two 32-element bf16 vectors a, b into pairs (a[j], b[j]):
// kPairsLo for j in [0, 16), kPairsHi for j in [16, 32) (index 32 + j selects b[j]).
alignas(64) constexpr uint16_t kPairsLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairsHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// Bits of the 32 tokens [base, base + 32) that lie in [lo, hi).
inline __mmask32 token_mask(int base, int lo, int hi) {
  const int a = std::clamp(lo - base, 0, 32), b = std::clamp(hi - base, 0, 32);
  if (b <= a) return 0;
  const uint64_t bits = ((uint64_t{1} << (b - a)) - 1) << a;
  return static_cast<__mmask32>(bits);
}

// C[r, 0 .. 16 N) (+)= sum_i A[r, 2i .. 2i + 1] . B[i][0 .. 16 N) for R rows: A bf16 rows a_stride apart
// (pairs along the reduction), B vectors of 16 bf16 pairs, b_step apart per reduction step. Both
// products are this: scores (A = Q, B = K by dim pairs) and P V (A = P, B = V by token pairs).
template <int R, int N>
SPARSEVER_AVX512_BF16 inline void dot_pairs_tile(const bf16* a, int64_t a_stride, int steps, const bf16* b,
                                                 int64_t b_step, float* c, int64_t c_stride, bool accumulate,
                                                 PrefetchStream* pf) {
  __m512 acc[R][N];
  SPARSEVER_UNROLL
  for (int r = 0; r < R; ++r)
    SPARSEVER_UNROLL
    for (int j = 0; j < N; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * c_stride + 16 * j) : _mm512_setzero_ps();
  for (int i = 0; i < steps; ++i) {
    if (pf) pf->step();
    const bf16* bi = b + i * b_step;
    __m512bh bv[N];
    SPARSEVER_UNROLL
    for (int j = 0; j < N; ++j) bv[j] = as_bh(_mm512_loadu_si512(bi + 32 * j));
    SPARSEVER_UNROLL
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * a_stride + 2 * i, sizeof(pair));
      const __m512bh av = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      SPARSEVER_UNROLL
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
  SPARSEVER_UNROLL
  for (int r = 0; r < R; ++r)
    SPARSEVER_UNROLL
    for (int j = 0; j < N; ++j) _mm512_storeu_ps(c + r * c_stride + 16 * j, acc[r][j]);
}

// R rows of dot_pairs_tile over columns [0, width), width a multiple of 32 (64 per tile, then 32).
template <int R>
SPARSEVER_AVX512_BF16 inline void dot_pairs_rows(const bf16* a, int64_t a_stride, int steps, const bf16* b,
                                                 int64_t b_step, int width, float* c, int64_t c_stride,
                                                 bool accumulate, PrefetchStream* pf) {
  int col = 0;
  for (; col + 64 <= width; col += 64)
    dot_pairs_tile<R, 4>(a, a_stride, steps, b + 2 * col, b_step, c + col, c_stride, accumulate, pf);
  if (col < width) dot_pairs_tile<R, 2>(a, a_stride, steps, b + 2 * col, b_step, c + col, c_stride, accumulate, pf);
}

// Every row: register tiles of 4 rows, then the remainder.
SPARSEVER_AVX512_BF16 inline void dot_pairs(const bf16* a, int64_t a_stride, int rows, int steps, const bf16* b,
                                            int64_t b_step, int width, float* c, int64_t c_stride, bool accumulate,
                                            PrefetchStream* pf) {
  int r = 0;
  for (; r + 4 <= rows; r += 4)
    dot_pairs_rows<4>(a + r * a_stride, a_stride, steps, b, b_step, width, c + r * c_stride, c_stride, accumulate, pf);
  const bf16* ar = a + r * a_stride;
  float* cr = c + r * c_stride;
  switch (rows - r) {
    case 3: dot_pairs_rows<3>(ar, a_stride, steps, b, b_step, width, cr, c_stride, accumulate, pf); break;
    case 2: dot_pairs_rows<2>(ar, a_stride, steps, b, b_step, width, cr, c_stride, accumulate, pf); break;
    case 1: dot_pairs_rows<1>(ar, a_stride, steps, b, b_step, width, cr, c_stride, accumulate, pf); break;
    default: break;
  }
}

// One segment on the plain layout with vdpbf16ps (d a multiple of 32). Tokens are taken in the
// 32-aligned range around [t_lo, t_hi); those outside it are loaded as zeros (masked loads: nothing past
// the segment is read) and masked out of the softmax.
SPARSEVER_AVX512_BF16 void dot_bf16_segment(const BlockSegment& sg, const bf16* q, int rows, float scale, float* m,
                                            float* l, float* acc, Bf16Scratch& buf, const BlockSegment* next) {
  const int d = sg.d;
  const int a_lo = sg.t_lo / 32 * 32, a_hi = (sg.t_hi + 31) / 32 * 32;
  const int ntp = a_hi - a_lo;
  const size_t kv_elems = static_cast<size_t>(ntp) * d;
  if (buf.k.size() < kv_elems) buf.k.resize(kv_elems);
  if (buf.v.size() < kv_elems) buf.v.resize(kv_elems);
  if (buf.s.size() < static_cast<size_t>(rows) * ntp) buf.s.resize(static_cast<size_t>(rows) * ntp);
  if (buf.p.size() < static_cast<size_t>(rows) * ntp) buf.p.resize(static_cast<size_t>(rows) * ntp);
  bf16* kp = buf.k.data();
  bf16* vp = buf.v.data();
  float* s = buf.s.data();
  bf16* p = buf.p.data();
  const __m512i lo_idx = _mm512_load_si512(kPairsLo), hi_idx = _mm512_load_si512(kPairsHi);
  // K^T rows (dims 2i, 2i + 1) -> kp [i][token][2].
  for (int i = 0; i < d / 2; ++i) {
    const bf16* k0 = sg.k_block + 2 * i * sg.k_stride_d + a_lo;
    const bf16* k1 = k0 + sg.k_stride_d;
    bf16* dst = kp + static_cast<int64_t>(i) * ntp * 2;
    for (int c = 0; c < ntp; c += 32) {
      const __mmask32 mk = token_mask(a_lo + c, sg.t_lo, sg.t_hi);
      const __m512i x = _mm512_maskz_loadu_epi16(mk, k0 + c), y = _mm512_maskz_loadu_epi16(mk, k1 + c);
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
  // V rows (tokens 2tp, 2tp + 1) -> vp [tp][dim][2]; tokens outside the segment are zeros (P is 0 there,
  // and 0 x NaN from an unwritten slot would not be).
  for (int tp = 0; tp < ntp / 2; ++tp) {
    const int t = a_lo + 2 * tp;
    const bool ok0 = t >= sg.t_lo && t < sg.t_hi, ok1 = t + 1 >= sg.t_lo && t + 1 < sg.t_hi;
    const bf16* v0 = sg.v_block + t * sg.v_stride_t;
    const bf16* v1 = v0 + sg.v_stride_t;
    bf16* dst = vp + static_cast<int64_t>(tp) * d * 2;
    for (int c = 0; c < d; c += 32) {
      const __m512i x = ok0 ? _mm512_loadu_si512(v0 + c) : _mm512_setzero_si512();
      const __m512i y = ok1 ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
  // The next segment's K and V stream in over this one's dot products (PrefetchStream).
  PrefetchStream pf;
  PrefetchStream* pfp = nullptr;
  if (next != nullptr) {
    pf.add(0, next->k_block, next->d, next->bs, next->k_stride_d);  // K^T: D rows of bs tokens
    pf.add(1, next->v_block, next->bs, next->d, next->v_stride_t);  // V: bs rows of D
    const int64_t groups = (rows + 3) / 4;
    const int64_t steps = groups * ((ntp + 63) / 64) * (d / 2) + groups * ((d + 63) / 64) * (ntp / 2);
    pf.per_step = static_cast<int>((pf.total[0] + pf.total[1] + steps - 1) / steps);
    pfp = &pf;
  }
  dot_pairs(q, d, rows, d / 2, kp, 2 * static_cast<int64_t>(ntp), ntp, s, ntp, false, pfp);  // scores
  softmax_rows_to_bf16(sg, a_lo, ntp, 0, rows, scale, s, p, m, l, acc);
  dot_pairs(p, ntp, rows, ntp / 2, vp, 2 * static_cast<int64_t>(d), d, acc, d, true, pfp);  // acc += P V
}
#endif  // CPU_CAPABILITY_AVX512

template <typename scalar_t>
void attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const torch::Tensor& block_table,
                    const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                    const std::optional<torch::Tensor>& selected, const std::optional<torch::Tensor>& num_selected,
                    const std::optional<torch::Tensor>& tree_mask, float scale, bool emulate_tiles,
                    AmxPrefetch amx_prefetch) {
  const int num_req = static_cast<int>(query_start_loc.size(0)) - 1;
  const int hq = static_cast<int>(query.size(1));
  const int d = static_cast<int>(query.size(2));
  const int hkv = static_cast<int>(key_cache.size(1));
  // 6-D caches: vLLM-CPU's AMX layout (see the top of the file); 4-D: [nb, Hkv, bs, D] with any strides.
  const bool amx_layout = key_cache.dim() == 6;
  const int bs = static_cast<int>(amx_layout ? key_cache.size(2) * 16 : key_cache.size(2));
  const int group = hq / hkv;
  const int dp = round_up(d, kVecLen);
  const int bsp = round_up(bs, kVecLen);

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  const int32_t* sel = selected ? selected->data_ptr<int32_t>() : nullptr;
  const int32_t* nsel = num_selected ? num_selected->data_ptr<int32_t>() : nullptr;
  const int64_t sel_s0 = selected ? selected->stride(0) : 0, sel_s1 = selected ? selected->stride(1) : 0;
  const int64_t nsel_s0 = num_selected ? num_selected->stride(0) : 0;
  const int64_t nsel_s1 = num_selected ? num_selected->stride(1) : 0;
  torch::Tensor mask_u8;
  if (tree_mask) mask_u8 = tree_mask->to(torch::kByte).contiguous();
  const uint8_t* mask = tree_mask ? mask_u8.data_ptr<uint8_t>() : nullptr;
  const int64_t mask_stride = tree_mask ? mask_u8.size(1) : 0;
  if (tree_mask) {
    TORCH_CHECK(mask_u8.dim() == 2 && mask_u8.size(0) == query.size(0), "tree_mask must be [T, max_q_len]");
    for (int r = 0; r < num_req; ++r)
      TORCH_CHECK(qsl[r + 1] - qsl[r] <= mask_stride, "tree_mask has fewer columns than a request's q_len");
  }

  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1);
  const int64_t ks_t = amx_layout ? 0 : key_cache.stride(2), ks_d = amx_layout ? 0 : key_cache.stride(3);
  const int64_t vs_t = amx_layout ? 0 : value_cache.stride(2), vs_d = amx_layout ? 0 : value_cache.stride(3);
  // Direct (copy-free) paths: vLLM-CPU's transposed K, row-major V, head_dim a multiple of the vector.
  const bool k_direct = !amx_layout && ks_t == 1 && d == dp;
  const bool v_direct = !amx_layout && vs_d == 1 && d == dp;
  // bf16 on the plain layout with vdpbf16ps (see the top of the file).
  bool dot_bf16 = false;
#if defined(CPU_CAPABILITY_AVX512)
  dot_bf16 = std::is_same_v<scalar_t, bf16> && k_direct && v_direct && d % 32 == 0 && use_attention_bf16_dot();
#endif

  const scalar_t* qp = query.data_ptr<scalar_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);

  // ---- plan: segments per (req, head), then items (split-K chunks) ----
  std::vector<std::vector<Segment>> segs(static_cast<size_t>(num_req) * hkv);
  int64_t total_ctx_segments = 0;
  for (int r = 0; r < num_req; ++r) {
    const int q_len = qsl[r + 1] - qsl[r];
    if (q_len == 0) continue;
    const int ctx_len = sl[r] - q_len;
    const int n_ctx_blocks = (ctx_len + bs - 1) / bs;
    for (int h = 0; h < hkv; ++h) {
      auto& list = segs[r * hkv + h];
      auto add_ctx = [&](int b) {
        TORCH_CHECK(b >= 0 && b < n_ctx_blocks, "selected block ", b, " of request ", r, " is not a context block");
        list.push_back({b, 0, std::min(bs, ctx_len - b * bs), false});
      };
      if (sel) {
        const int n = nsel[r * nsel_s0 + h * nsel_s1];
        for (int i = 0; i < n; ++i) add_ctx(sel[r * sel_s0 + h * sel_s1 + i]);
      } else {
        for (int b = 0; b < n_ctx_blocks; ++b) add_ctx(b);
      }
      total_ctx_segments += static_cast<int64_t>(list.size());
      for (int pos = ctx_len; pos < sl[r];) {
        const int b = pos / bs;
        const int hi = std::min(sl[r] - b * bs, bs);
        list.push_back({b, pos - b * bs, hi, true});
        pos = b * bs + hi;
      }
    }
  }
  // Many rows (long drafts x large GQA groups) in bf16/fp16 make attention compute-bound: there ATen's
  // SDPA (oneDNN/AMX on CPUs that have it) over the gathered selected tokens beats FMA microkernels.
  // The gather reads exactly the selected blocks, like the kernel. Needs >= 1 context token per head
  // so that no row is fully masked (SDPA would give NaN where the op defines zeros).
  if constexpr (!std::is_same_v<scalar_t, float>) {
    const int64_t min_rows = amx_layout ? std::numeric_limits<int64_t>::max() : sdpa_min_rows();
    for (int r = 0; r < num_req; ++r) {
      const int q_len = qsl[r + 1] - qsl[r];
      if (q_len == 0 || static_cast<int64_t>(q_len) * group < min_rows) continue;
      bool has_ctx = true;
      for (int h = 0; h < hkv; ++h) {
        const auto& list = segs[r * hkv + h];
        has_ctx = has_ctx && !list.empty() && !list.front().is_query && list.front().t_hi > list.front().t_lo;
      }
      if (!has_ctx) continue;
      const int t0 = qsl[r], ctx_len = sl[r] - q_len;
      for (int h = 0; h < hkv; ++h) {
        auto& list = segs[r * hkv + h];
        std::vector<torch::Tensor> ks, vs;
        int64_t n_ctx_tokens = 0;
        for (const Segment& seg : list) {
          const int64_t phys = bt[r * bt_stride + seg.block];
          ks.push_back(key_cache.select(0, phys).select(0, h).narrow(0, seg.t_lo, seg.t_hi - seg.t_lo));
          vs.push_back(value_cache.select(0, phys).select(0, h).narrow(0, seg.t_lo, seg.t_hi - seg.t_lo));
          if (!seg.is_query) n_ctx_tokens += seg.t_hi - seg.t_lo;
        }
        const int64_t total = n_ctx_tokens + q_len;
        auto attn_mask = torch::ones({q_len, total}, torch::kBool);
        auto qmask = attn_mask.narrow(1, n_ctx_tokens, q_len);
        if (mask) {
          qmask.copy_(mask_u8.narrow(0, t0, q_len).narrow(1, 0, q_len).to(torch::kBool));
        } else {
          qmask.copy_(torch::ones({q_len, q_len}, torch::kBool).tril());
        }
        (void)ctx_len;
        auto k = at::cat(ks).view({1, 1, total, d});
        auto v = at::cat(vs).view({1, 1, total, d});
        auto q = query.narrow(0, t0, q_len).narrow(1, h * group, group).transpose(0, 1).unsqueeze(0);
        auto o = at::scaled_dot_product_attention(q, k, v, attn_mask, 0.0, false, static_cast<double>(scale), true);
        out.narrow(0, t0, q_len).narrow(1, h * group, group).copy_(o.squeeze(0).transpose(0, 1));
        list.clear();  // done: no kernel items for this (request, head)
      }
    }
  }

  const int num_threads = at::get_num_threads();
  // Split-K chunk: enough items to keep every thread busy, but >= 2 blocks per item to bound merges.
  const int64_t chunk =
      std::max<int64_t>(2, (total_ctx_segments + 4 * num_threads - 1) / (4 * num_threads));
  std::vector<WorkItem> items;
  int64_t partial_size = 0;
  for (int r = 0; r < num_req; ++r) {
    const int rows = (qsl[r + 1] - qsl[r]) * group;
    for (int h = 0; h < hkv; ++h) {
      const auto& list = segs[r * hkv + h];
      for (int64_t s = 0; s < static_cast<int64_t>(list.size()); s += chunk) {
        int64_t e = std::min<int64_t>(s + chunk, list.size());
        // Keep a short remainder (e.g. the query tail) with this chunk rather than alone.
        if (static_cast<int64_t>(list.size()) - e <= 2) e = static_cast<int64_t>(list.size());
        items.push_back({r, h, static_cast<int32_t>(s), static_cast<int32_t>(e), partial_size});
        partial_size += static_cast<int64_t>(rows) * (dp + 2);
        s = e - chunk;  // the loop's += chunk continues at e
      }
    }
  }
  // Every item initialises its own m/l/acc, so the buffer is left uninitialised (no zero-fill pass).
  std::unique_ptr<float[]> partial_buf(new float[std::max<int64_t>(1, partial_size)]);
  float* const partial = partial_buf.get();

  // Items of one (req, head) are contiguous: first_item[rh] .. first_item[rh + 1].
  std::vector<int64_t> first_item(static_cast<size_t>(num_req) * hkv + 1, 0);
  {
    size_t i = 0;
    for (int rh = 0; rh < num_req * hkv; ++rh) {
      first_item[rh] = static_cast<int64_t>(i);
      while (i < items.size() && items[i].req * hkv + items[i].head == rh) ++i;
    }
    first_item[num_req * hkv] = static_cast<int64_t>(items.size());
  }
  // Merge of the split-K partials of one (req, head), run by whichever thread finishes its last item,
  // so the whole op is a single parallel region (each region costs a worker wake-up).
  auto merge = [&](int64_t rh, std::vector<float>& row_out) {
    row_out.resize(dp);
    const int r = static_cast<int>(rh / hkv), h = static_cast<int>(rh % hkv);
    const int t0 = qsl[r], q_len = qsl[r + 1] - t0;
    const int rows = q_len * group;
    for (int row = 0; row < rows; ++row) {
      float m_all = kNegInf;
      for (int64_t it = first_item[rh]; it < first_item[rh + 1]; ++it)
        m_all = std::max(m_all, partial[items[it].partial_offset + row]);
      std::fill(row_out.begin(), row_out.end(), 0.f);
      float l_all = 0.f;
      if (m_all != kNegInf) {
        for (int64_t it = first_item[rh]; it < first_item[rh + 1]; ++it) {
          const float* m = partial + items[it].partial_offset;
          if (m[row] == kNegInf) continue;
          const float w = std::exp(m[row] - m_all);
          l_all += m[rows + row] * w;
          const float* arow = m + 2 * rows + static_cast<int64_t>(row) * dp;
          for (int c = 0; c < dp; ++c) row_out[c] += w * arow[c];
        }
      }
      const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
      for (int c = 0; c < d; ++c) row_out[c] *= inv;
      const int i = row / group, g = row % group;
      store_from_f32<scalar_t>(row_out.data(), op + (t0 + i) * os0 + (h * group + g) * os1, d);
    }
  };
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[static_cast<size_t>(num_req) * hkv + 1]);
  for (int64_t rh = 0; rh < static_cast<int64_t>(num_req) * hkv; ++rh)
    pending[rh].store(first_item[rh + 1] - first_item[rh], std::memory_order_relaxed);

  // ---- compute items ----
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> q_buf, s_buf, k_buf, v_buf, merge_buf;
#if defined(CPU_CAPABILITY_AVX512)
    thread_local Bf16Scratch bf16_buf;
    thread_local AmxPipelineBuffers amx_buf;
    amx::TileState<amx::Hardware> tiles;  // released when the chunk ends
    amx::TileState<amx::Emulated> emulated_tiles;
#endif
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const int r = item.req, h = item.head;
      const int t0 = qsl[r], q_len = qsl[r + 1] - t0;
      const int rows = q_len * group;
      const int ctx_len = sl[r] - q_len;
      float* m = partial + item.partial_offset;
      float* l = m + rows;
      float* acc = l + rows;
      std::fill(m, m + rows, kNegInf);
      std::fill(l, l + rows, 0.f);
      std::fill(acc, acc + static_cast<int64_t>(rows) * dp, 0.f);
      const auto& list = segs[r * hkv + h];
      const int64_t rh = static_cast<int64_t>(r) * hkv + h;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<scalar_t, bf16>) {
        if (amx_layout || dot_bf16) {
          // Q rows (token i, head g) -> row i*group+g, bf16 as given (the scale goes on the scores).
          if (bf16_buf.q.size() < static_cast<size_t>(rows) * d) bf16_buf.q.resize(static_cast<size_t>(rows) * d);
          bf16* qb = bf16_buf.q.data();
          for (int i = 0; i < q_len; ++i)
            for (int g = 0; g < group; ++g)
              std::memcpy(static_cast<void*>(qb + static_cast<int64_t>(i * group + g) * d),
                          qp + (t0 + i) * qs0 + (h * group + g) * qs1, d * sizeof(bf16));
          auto& sgs = amx_buf.segments;
          sgs.clear();
          for (int si = item.seg_begin; si < item.seg_end; ++si) {
            const Segment& seg = list[si];
            if (seg.t_hi <= seg.t_lo) continue;
            const int64_t phys = bt[r * bt_stride + seg.block];
            sgs.push_back({kc + phys * ks0 + h * ks1, vc + phys * vs0 + h * vs1, ks_d, vs_t, bs, d, seg.t_lo, seg.t_hi,
                           seg.is_query, seg.block, ctx_len, t0, group, mask, mask_stride});
          }
          if (amx_layout) {
            if (emulate_tiles) {
              amx_item(sgs, qb, rows, scale, m, l, acc, emulated_tiles, amx_buf, amx_prefetch);
            } else {
              amx_item(sgs, qb, rows, scale, m, l, acc, tiles, amx_buf, amx_prefetch);  // prefetches ahead itself
            }
          } else {
            for (size_t j = 0; j < sgs.size(); ++j)  // blocks are scattered: each streams in the next one
              dot_bf16_segment(sgs[j], qb, rows, scale, m, l, acc, bf16_buf, j + 1 < sgs.size() ? &sgs[j + 1] : nullptr);
          }
          if (pending[rh].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(rh, merge_buf);
          continue;
        }
      }
#endif
      // Q rows (token i, head g) -> row i*group+g, pre-scaled, zero-padded to dp.
      float* qs = scratch(q_buf, static_cast<size_t>(rows) * dp);
      for (int i = 0; i < q_len; ++i)
        for (int g = 0; g < group; ++g) {
          float* dst = qs + (i * group + g) * dp;
          const scalar_t* src = qp + (t0 + i) * qs0 + (h * group + g) * qs1;
          for (int c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * scale;
          for (int c = d; c < dp; ++c) dst[c] = 0.f;
        }
      float* s = scratch(s_buf, static_cast<size_t>(rows) * bsp);
      for (int si = item.seg_begin; si < item.seg_end; ++si) {
        const Segment& seg = list[si];
        const int ntok = seg.t_hi - seg.t_lo;
        if (ntok <= 0) continue;
        const int ntp = round_up(ntok, kVecLen);
        const int64_t phys = bt[r * bt_stride + seg.block];
        const scalar_t* kb = kc + phys * ks0 + h * ks1;
        const scalar_t* vb = vc + phys * vs0 + h * vs1;
        if (si + 1 < item.seg_end && k_direct && v_direct) {
          // Selected blocks are scattered: prefetch the next one's K and V while this one is computed.
          const int64_t next = bt[r * bt_stride + list[si + 1].block];
          prefetch_2d(kc + next * ks0 + h * ks1, d, ks_d, bs);  // K^T: D rows of bs tokens
          prefetch_2d(vc + next * vs0 + h * vs1, bs, vs_t, d);  // V: bs rows of D
        }
        // Scores.
        if (k_direct && seg.t_lo + ntp <= bs) {
          qk_rows<scalar_t>(qs, rows, dp, kb + seg.t_lo, ks_d, ntp, s, bsp);
        } else {
          float* kp = scratch(k_buf, static_cast<size_t>(dp) * ntp);
          for (int c = 0; c < dp; ++c)
            for (int t = 0; t < ntp; ++t)
              kp[c * ntp + t] = (c < d && t < ntok) ? static_cast<float>(kb[(seg.t_lo + t) * ks_t + c * ks_d]) : 0.f;
          qk_rows<float>(qs, rows, dp, kp, ntp, ntp, s, bsp);
        }
        // Masks: padded columns always; query columns by the tree (or causal) mask. Then the online
        // softmax step; s becomes P.
        for (int row = 0; row < rows; ++row) {
          float* srow = s + row * bsp;
          for (int t = ntok; t < ntp; ++t) srow[t] = kNegInf;
          if (seg.is_query) {
            const int i = row / group;
            mask_query_columns(srow, 0, ntok, seg.block * bs + seg.t_lo - ctx_len, i,
                               mask ? mask + (t0 + i) * mask_stride : nullptr);
          }
          online_softmax_row(srow, ntp, m[row], l[row], acc + row * dp, dp);
        }
        // acc += P V.
        if (v_direct) {
          pv_rows<scalar_t>(s, bsp, rows, vb + seg.t_lo * vs_t, vs_t, ntok, dp, acc);
        } else {
          float* vp = scratch(v_buf, static_cast<size_t>(ntok) * dp);
          for (int t = 0; t < ntok; ++t)
            for (int c = 0; c < dp; ++c)
              vp[t * dp + c] = c < d ? static_cast<float>(vb[(seg.t_lo + t) * vs_t + c * vs_d]) : 0.f;
          pv_rows<float>(s, bsp, rows, vp, dp, ntok, dp, acc);
        }
      }
      // The last finished item of a (req, head) merges; acq_rel makes the other items' partials visible.
      if (pending[rh].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(rh, merge_buf);
    }
  });

}

}  // namespace
}  // namespace sparsever::cpu

void block_sparse_tree_attention_cpu(torch::Tensor& out, const torch::Tensor& query,
                                     const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                                     const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                     const torch::Tensor& query_start_loc,
                                     const std::optional<torch::Tensor>& selected,
                                     const std::optional<torch::Tensor>& num_selected,
                                     const std::optional<torch::Tensor>& tree_mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, Hq, D]");
  bool emulate_tiles = false;  // the AMX layout's tile products on amx::Emulated (tests; amx_tiles.h)
  auto amx_prefetch = sparsever::cpu::AmxPrefetch::kPages;
  if (key_cache.dim() == 6) {
    // vLLM-CPU's AMX layout: K [nb, Hkv, bs/16, D/2, 16, 2], V [nb, Hkv, D/16, bs/2, 16, 2].
    const int64_t bs = key_cache.size(2) * 16, d = key_cache.size(3) * 2;
    TORCH_CHECK(key_cache.size(4) == 16 && key_cache.size(5) == 2 && value_cache.dim() == 6 &&
                    value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == key_cache.size(1) &&
                    value_cache.size(2) * 16 == d && value_cache.size(3) * 2 == bs && value_cache.size(4) == 16 &&
                    value_cache.size(5) == 2,
                "AMX-layout caches must be K [nb, Hkv, bs/16, D/2, 16, 2] and V [nb, Hkv, D/16, bs/2, 16, 2]");
    TORCH_CHECK(bs % 32 == 0 && d % 32 == 0, "the AMX layout needs block_size and head_dim multiples of 32");
    TORCH_CHECK(key_cache.stride(5) == 1 && key_cache.stride(4) == 2 && key_cache.stride(3) == 32 &&
                    key_cache.stride(2) == 16 * d && value_cache.stride(5) == 1 && value_cache.stride(4) == 2 &&
                    value_cache.stride(3) == 32 && value_cache.stride(2) == 16 * bs,
                "AMX-layout caches must be contiguous within a block and head");
    TORCH_CHECK(d == query.size(2), "head_dim mismatch");
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16, "the AMX KV layout holds bf16 only");
#if defined(CPU_CAPABILITY_AVX512)
    emulate_tiles = sparsever::cpu::amx::emulation_enabled();
    amx_prefetch = sparsever::cpu::amx_prefetch_from_env();
    TORCH_CHECK(sparsever::cpu::amx::tiles_usable(emulate_tiles),
                "the AMX KV layout needs a CPU with AMX-BF16 (or SPARSEVER_CPU_AMX_EMULATE=1 on one with AVX512-BF16)");
#else
    TORCH_CHECK(false, "the AMX KV layout needs the AVX-512 build of the extension on a CPU with AMX-BF16");
#endif
  } else {
    TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
                "key_cache/value_cache must be [num_blocks, Hkv, block_size, D] (or the 6-D AMX layout)");
    TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim mismatch");
  }
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and caches must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out need a contiguous head_dim");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                  query_start_loc.scalar_type() == torch::kInt,
              "block_table, seq_lens, query_start_loc must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "index tensors must be contiguous");
  TORCH_CHECK(selected.has_value() == num_selected.has_value(), "selected and num_selected go together");
  if (selected) {
    TORCH_CHECK(selected->scalar_type() == torch::kInt && num_selected->scalar_type() == torch::kInt,
                "selected/num_selected must be int32");
    TORCH_CHECK(selected->stride(2) == 1, "selected needs a contiguous last dim");
  }
  SPARSEVER_DISPATCH_FLOAT_TYPES(query.scalar_type(), "block_sparse_tree_attention_cpu", [&] {
    sparsever::cpu::attention_impl<scalar_t>(out, query, key_cache, value_cache, block_table, seq_lens,
                                             query_start_loc, selected, num_selected, tree_mask,
                                             static_cast<float>(scale), emulate_tiles, amx_prefetch);
  });
}
