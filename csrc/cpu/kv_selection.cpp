// KV block key summaries (Quest-style per-channel min/max) and top-k block selection (CPU).
#include "cpu_utils.h"
#include "ops.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace sparsever::cpu {
namespace {

template <typename scalar_t>
void summaries_impl(const torch::Tensor& key_cache, const std::vector<std::pair<int64_t, int>>& touched,
                    torch::Tensor& key_min, torch::Tensor& key_max) {
  const int hkv = static_cast<int>(key_cache.size(1));
  const int d = static_cast<int>(key_cache.size(3));
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const int64_t s0 = key_cache.stride(0), s1 = key_cache.stride(1), st = key_cache.stride(2),
                sd = key_cache.stride(3);
  float* kmin = key_min.data_ptr<float>();
  float* kmax = key_max.data_ptr<float>();
  // A verify step touches a few blocks: run those inline (a parallel region costs a worker wake-up);
  // prefill touches many and is split across threads.
  at::parallel_for(0, static_cast<int64_t>(touched.size()) * hkv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = touched[w / hkv].first;
      const int ntok = touched[w / hkv].second + 1;
      const int h = static_cast<int>(w % hkv);
      const scalar_t* base = kc + b * s0 + h * s1;
      float* mn = kmin + (b * hkv + h) * d;
      float* mx = kmax + (b * hkv + h) * d;
      if (st == 1) {
        // vLLM-CPU layout: each channel's keys are contiguous over tokens.
        for (int c = 0; c < d; ++c) {
          const scalar_t* row = base + c * sd;
          int t = 0;
          Vec vmn(std::numeric_limits<float>::infinity()), vmx(-std::numeric_limits<float>::infinity());
          for (; t + kVecLen <= ntok; t += kVecLen) {
            Vec k = load_f32<scalar_t>(row + t);
            vmn = at::vec::minimum(vmn, k);
            vmx = at::vec::maximum(vmx, k);
          }
          float lo = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b2) { return at::vec::minimum(a, b2); }, vmn);
          float hi = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b2) { return at::vec::maximum(a, b2); }, vmx);
          for (; t < ntok; ++t) {
            lo = std::min(lo, static_cast<float>(row[t]));
            hi = std::max(hi, static_cast<float>(row[t]));
          }
          mn[c] = lo;
          mx[c] = hi;
        }
      } else {
        // Token-major layout: fold token rows channel-wise.
        for (int c = 0; c < d; ++c) mn[c] = mx[c] = static_cast<float>(base[c * sd]);
        for (int t = 1; t < ntok; ++t) {
          const scalar_t* row = base + t * st;
          for (int c = 0; c < d; ++c) {
            const float v = static_cast<float>(row[c * sd]);
            mn[c] = std::min(mn[c], v);
            mx[c] = std::max(mx[c], v);
          }
        }
      }
    }
  });
}

// Quest upper bound of one block for one KV head: sum over the group's query heads and channels.
inline float quest_score(const float* q, int group, int d, const float* mn, const float* mx) {
  Vec acc(0.f);
  int c = 0;
  float tail = 0.f;
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    for (c = 0; c + kVecLen <= d; c += kVecLen) {
      Vec qv = Vec::loadu(qg + c);
      acc = acc + at::vec::maximum(qv * Vec::loadu(mn + c), qv * Vec::loadu(mx + c));
    }
    for (; c < d; ++c) tail += std::max(qg[c] * mn[c], qg[c] * mx[c]);
  }
  return hsum(acc) + tail;
}

}  // namespace
}  // namespace sparsever::cpu

void update_block_key_summaries_cpu(const torch::Tensor& key_cache, const torch::Tensor& slot_mapping,
                                    int64_t block_size, torch::Tensor& key_min, torch::Tensor& key_max) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(2) == block_size, "key_cache must be [nb, Hkv, block_size, D]");
  TORCH_CHECK(key_min.scalar_type() == torch::kFloat && key_max.scalar_type() == torch::kFloat &&
                  key_min.is_contiguous() && key_max.is_contiguous(),
              "key_min/key_max must be contiguous fp32");
  TORCH_CHECK(key_min.dim() == 3 && key_min.size(0) == key_cache.size(0) && key_min.size(1) == key_cache.size(1) &&
                  key_min.size(2) == key_cache.size(3) && key_max.sizes() == key_min.sizes(),
              "key_min/key_max must be [nb, Hkv, D]");
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Touched blocks with their fill level (largest written offset); first-seen order.
  std::unordered_map<int64_t, size_t> where;
  std::vector<std::pair<int64_t, int>> touched;
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (sp[i] < 0) continue;
    const int64_t b = sp[i] / block_size;
    const int off = static_cast<int>(sp[i] % block_size);
    TORCH_CHECK(b < key_cache.size(0), "slot out of range");
    auto [pos, inserted] = where.try_emplace(b, touched.size());
    if (inserted) touched.emplace_back(b, off);
    else touched[pos->second].second = std::max(touched[pos->second].second, off);
  }
  if (touched.empty()) return;
  SPARSEVER_DISPATCH_FLOAT_TYPES(key_cache.scalar_type(), "update_block_key_summaries_cpu", [&] {
    sparsever::cpu::summaries_impl<scalar_t>(key_cache, touched, key_min, key_max);
  });
}

void select_kv_blocks_cpu(const torch::Tensor& query_pooled, const torch::Tensor& key_min,
                          const torch::Tensor& key_max, const torch::Tensor& block_table,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_lens, int64_t block_size,
                          int64_t top_k, int64_t num_sink, int64_t num_local, torch::Tensor& selected,
                          torch::Tensor& num_selected) {
  using namespace sparsever::cpu;
  TORCH_CHECK(query_pooled.dim() == 3 && key_min.dim() == 3, "query_pooled [R, Hq, D], key_min [nb, Hkv, D]");
  TORCH_CHECK(key_min.scalar_type() == torch::kFloat && key_max.scalar_type() == torch::kFloat &&
                  key_min.is_contiguous() && key_max.is_contiguous(),
              "key_min/key_max must be contiguous fp32");
  TORCH_CHECK(selected.scalar_type() == torch::kInt && num_selected.scalar_type() == torch::kInt &&
                  selected.is_contiguous() && num_selected.is_contiguous(),
              "selected/num_selected must be contiguous int32");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                  query_lens.scalar_type() == torch::kInt,
              "block_table, seq_lens, query_lens must be int32");
  TORCH_CHECK(top_k >= 0 && num_sink >= 0 && num_local >= 0, "top_k, num_sink, num_local must be >= 0");
  const int num_req = static_cast<int>(selected.size(0));
  const int hkv = static_cast<int>(selected.size(1));
  const int slots = static_cast<int>(selected.size(2));
  const int hq = static_cast<int>(query_pooled.size(1));
  const int d = static_cast<int>(query_pooled.size(2));
  TORCH_CHECK(key_min.size(1) == hkv && hq % hkv == 0 && key_min.size(2) == d, "head shapes mismatch");
  const int group = hq / hkv;
  auto q = query_pooled.to(torch::kFloat).contiguous();
  auto sl = seq_lens.contiguous(), ql = query_lens.contiguous();
  auto bt = block_table.contiguous();
  const float* qp = q.data_ptr<float>();
  const float* kmin = key_min.data_ptr<float>();
  const float* kmax = key_max.data_ptr<float>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  const int32_t* qlp = ql.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  int32_t* out = selected.data_ptr<int32_t>();
  int32_t* nout = num_selected.data_ptr<int32_t>();
  const int64_t budget = top_k + num_sink + num_local;
  for (int r = 0; r < num_req; ++r) {
    const int64_t ctx = std::max(0, slp[r] - qlp[r]);
    const int64_t n = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(n <= max_blocks, "block_table too short for seq_lens");
    TORCH_CHECK(std::min(n, budget) <= slots, "selected has ", slots, " slots per head, request ", r, " needs ",
                std::min(n, budget));
  }
  // Scoring is ~D flops per block and head: small batches run inline, large ones in parallel.
  int64_t total_blocks = 0;
  for (int r = 0; r < num_req; ++r) total_blocks += (std::max(0, slp[r] - qlp[r]) + block_size - 1) / block_size;
  const int64_t grain = total_blocks * hkv < 4096 ? std::max<int64_t>(1, static_cast<int64_t>(num_req) * hkv) : 1;
  at::parallel_for(0, static_cast<int64_t>(num_req) * hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int32_t> order;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int r = static_cast<int>(rh / hkv), h = static_cast<int>(rh % hkv);
      int32_t* dst = out + rh * slots;
      std::fill(dst, dst + slots, -1);
      const int64_t ctx = std::max(0, slp[r] - qlp[r]);
      const int n = static_cast<int>((ctx + block_size - 1) / block_size);
      if (n <= budget) {
        for (int b = 0; b < n; ++b) dst[b] = b;
        nout[rh] = n;
        continue;
      }
      const int lo = static_cast<int>(num_sink), hi = n - static_cast<int>(num_local);
      scores.resize(hi - lo);
      order.resize(hi - lo);
      const float* qh = qp + (static_cast<int64_t>(r) * hq + h * group) * d;
      for (int b = lo; b < hi; ++b) {
        const int64_t phys = btp[r * max_blocks + b];
        scores[b - lo] = quest_score(qh, group, d, kmin + (phys * hkv + h) * d, kmax + (phys * hkv + h) * d);
      }
      std::iota(order.begin(), order.end(), 0);
      // Larger score first, lower block index wins ties: a strict total order, so deterministic.
      if (top_k > 0) {
        std::nth_element(order.begin(), order.begin() + (top_k - 1), order.end(), [&](int32_t a, int32_t b) {
          return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
        });
        std::sort(order.begin(), order.begin() + top_k);
      }
      int k = 0;
      for (int b = 0; b < lo; ++b) dst[k++] = b;
      for (int i = 0; i < top_k; ++i) dst[k++] = order[i] + lo;
      for (int b = hi; b < n; ++b) dst[k++] = b;
      nout[rh] = k;
    }
  });
}
