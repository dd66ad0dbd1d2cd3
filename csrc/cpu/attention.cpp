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
#include "cpu_utils.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>

namespace sparsever::cpu {
namespace {

constexpr int kRowTile = 4;
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

// S[r, t] = sum_d Q[r, d] * K[d, t] for ROWS rows and ntp tokens (multiple of kVecLen).
template <int ROWS, typename KT>
inline void qk_tile(const float* q, int64_t q_stride, const KT* k, int64_t k_stride_d, int dp, int ntp,
                    float* s, int64_t s_stride) {
  int t = 0;
  for (; t + 2 * kVecLen <= ntp; t += 2 * kVecLen) {
    Vec acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = Vec(0.f);
    for (int d = 0; d < dp; ++d) {
      const KT* kd = k + d * k_stride_d + t;
      Vec k0 = load_f32<KT>(kd), k1 = load_f32<KT>(kd + kVecLen);
      for (int r = 0; r < ROWS; ++r) {
        Vec qv(q[r * q_stride + d]);
        acc0[r] = at::vec::fmadd(qv, k0, acc0[r]);
        acc1[r] = at::vec::fmadd(qv, k1, acc1[r]);
      }
    }
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
  constexpr int kCols = 4;  // vectors of D per tile: ROWS*kCols accumulators
  int c = 0;
  for (; c + kCols * kVecLen <= dp; c += kCols * kVecLen) {
    Vec a[ROWS][kCols];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < kCols; ++j) a[r][j] = Vec::loadu(acc + r * acc_stride + c + j * kVecLen);
    for (int t = 0; t < ntok; ++t) {
      const VT* vt = v + t * v_stride_t + c;
      Vec vv[kCols];
      for (int j = 0; j < kCols; ++j) vv[j] = load_f32<VT>(vt + j * kVecLen);
      for (int r = 0; r < ROWS; ++r) {
        Vec pv(p[r * p_stride + t]);
        for (int j = 0; j < kCols; ++j) a[r][j] = at::vec::fmadd(pv, vv[j], a[r][j]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
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

template <typename scalar_t>
void attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const torch::Tensor& block_table,
                    const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                    const std::optional<torch::Tensor>& selected, const std::optional<torch::Tensor>& num_selected,
                    const std::optional<torch::Tensor>& tree_mask, float scale) {
  const int num_req = static_cast<int>(query_start_loc.size(0)) - 1;
  const int hq = static_cast<int>(query.size(1));
  const int d = static_cast<int>(query.size(2));
  const int hkv = static_cast<int>(key_cache.size(1));
  const int bs = static_cast<int>(key_cache.size(2));
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
  if (tree_mask) mask_u8 = tree_mask->to(torch::kUInt8).contiguous();
  const uint8_t* mask = tree_mask ? mask_u8.data_ptr<uint8_t>() : nullptr;
  const int64_t mask_stride = tree_mask ? mask_u8.size(1) : 0;
  if (tree_mask) {
    TORCH_CHECK(mask_u8.dim() == 2 && mask_u8.size(0) == query.size(0), "tree_mask must be [T, max_q_len]");
    for (int r = 0; r < num_req; ++r)
      TORCH_CHECK(qsl[r + 1] - qsl[r] <= mask_stride, "tree_mask has fewer columns than a request's q_len");
  }

  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks_t = key_cache.stride(2),
                ks_d = key_cache.stride(3);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs_t = value_cache.stride(2),
                vs_d = value_cache.stride(3);
  // Direct (copy-free) paths: vLLM-CPU's transposed K, row-major V, head_dim a multiple of the vector.
  const bool k_direct = ks_t == 1 && d == dp;
  const bool v_direct = vs_d == 1 && d == dp;

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
    const int64_t min_rows = sdpa_min_rows();
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
      const auto& list = segs[r * hkv + h];
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
        // Masks: padded columns always; query columns by the tree (or causal) mask.
        for (int row = 0; row < rows; ++row) {
          float* srow = s + row * bsp;
          for (int t = ntok; t < ntp; ++t) srow[t] = kNegInf;
          if (seg.is_query) {
            const int i = row / group;
            for (int t = 0; t < ntok; ++t) {
              const int j = seg.block * bs + seg.t_lo + t - ctx_len;
              const bool ok = mask ? mask[(t0 + i) * mask_stride + j] != 0 : j <= i;
              if (!ok) srow[t] = kNegInf;
            }
          }
        }
        // Online softmax update; s becomes P.
        for (int row = 0; row < rows; ++row) {
          float* srow = s + row * bsp;
          Vec vmax(kNegInf);
          for (int t = 0; t < ntp; t += kVecLen) vmax = at::vec::maximum(vmax, Vec::loadu(srow + t));
          const float seg_max = at::vec::vec_reduce_all<float>(
              [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
          const float m_new = std::max(m[row], seg_max);
          if (m_new == kNegInf) {  // nothing allowed yet in this row
            std::fill(srow, srow + ntp, 0.f);
            continue;
          }
          const float alpha = std::exp(m[row] - m_new);  // exp(-inf) = 0 on the first segment
          Vec vsum(0.f), vm(m_new);
          for (int t = 0; t < ntp; t += kVecLen) {
            Vec p = (Vec::loadu(srow + t) - vm).exp_u20();
            p.store(srow + t);
            vsum = vsum + p;
          }
          l[row] = l[row] * alpha + hsum(vsum);
          m[row] = m_new;
          if (alpha != 1.f) {
            float* arow = acc + row * dp;
            Vec va(alpha);
            for (int c = 0; c < dp; c += kVecLen) (Vec::loadu(arow + c) * va).store(arow + c);
          }
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
      const int64_t rh = static_cast<int64_t>(r) * hkv + h;
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
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache/value_cache must be [num_blocks, Hkv, block_size, D]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim mismatch");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and caches must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out need a contiguous head_dim");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_table, seq_lens, query_start_loc must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "index tensors must be contiguous");
  TORCH_CHECK(selected.has_value() == num_selected.has_value(), "selected and num_selected go together");
  if (selected) {
    TORCH_CHECK(selected->scalar_type() == torch::kInt32 && num_selected->scalar_type() == torch::kInt32,
                "selected/num_selected must be int32");
    TORCH_CHECK(selected->stride(2) == 1, "selected needs a contiguous last dim");
  }
  SPARSEVER_DISPATCH_FLOAT_TYPES(query.scalar_type(), "block_sparse_tree_attention_cpu", [&] {
    sparsever::cpu::attention_impl<scalar_t>(out, query, key_cache, value_cache, block_table, seq_lens,
                                             query_start_loc, selected, num_selected, tree_mask,
                                             static_cast<float>(scale));
  });
}
