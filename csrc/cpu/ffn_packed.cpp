// Top-k SwiGLU FFN over neuron *blocks* in a packed bf16 layout made once at load time
// (vllm_sparsever/reference.py: pack_swiglu_ffn_blocks), for few-token verification steps.
//
// Why packed: the row-major kernel (ffn_moe.cpp) widens every bf16 weight to fp32 and issues one FMA
// per token per 16 weights; at 4 verify tokens that is compute-bound per core, below what oneDNN's
// packed bf16 GEMM reads. Here weights are stored the way AVX512-BF16's `vdpbf16ps` consumes them
// (pairs along the reduction axis, 16 outputs per 64-byte load), so one instruction does 32 multiply-adds
// per token straight from memory, and a kept block of 16 neurons is one contiguous read:
//   gate/up  [nb, H/2, 16, 2]        16 neurons of a block x pairs of input channels
//   down     [nb, H/16, 8, 16, 2]    per 16 output channels: the block's 8 neuron pairs
// Selection is per block (sum of the block's neuron scores), one block set per token group.
// CPUs without AVX512-BF16 (and the AVX2 build) run a portable loop over the same layout: correct,
// not fast; the Python side only picks this op where the fast path exists (ffn_packed_isa()).
#include "cpu_utils.h"
#include "gemv_rows.h"
#include "ops.h"

#include <algorithm>
#include <numeric>

namespace sparsever::cpu {
namespace {

constexpr int64_t kBlock = 16;     // neurons per block = fp32 lanes of one zmm
constexpr int64_t kPairs = kBlock / 2;
constexpr int kTokTile = 4;        // tokens per register tile
constexpr int kColVecs = 4;        // 16-column vectors per down-projection register tile
constexpr int64_t kDownBlocks = 8; // kept blocks per down-projection pass (next pass prefetched)

inline float bf16_lo(uint32_t pair) {
  uint32_t bits = pair << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float bf16_hi(uint32_t pair) {
  uint32_t bits = pair & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t bf16_pair(float lo, float hi) {
  const uint16_t l = c10::BFloat16(lo).x, h = c10::BFloat16(hi).x;
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

// ---- portable kernels (any CPU): the semantics of the fast ones -----------------------------------

// y[t, i] = x[t] . W_block[i] for the block's 16 neurons; x as bf16 pairs [nt, hp], y row stride ys.
void block_dot_portable(const uint32_t* x, int64_t nt, int64_t hp, const uint32_t* w, float* y, int64_t ys) {
  for (int64_t t = 0; t < nt; ++t) {
    float acc[kBlock] = {};
    for (int64_t p = 0; p < hp; ++p) {
      const float xl = bf16_lo(x[t * hp + p]), xh = bf16_hi(x[t * hp + p]);
      for (int64_t i = 0; i < kBlock; ++i) acc[i] += bf16_lo(w[p * kBlock + i]) * xl + bf16_hi(w[p * kBlock + i]) * xh;
    }
    std::copy_n(acc, kBlock, y + t * ys);
  }
}

// out[t, 16cv..16cv+15] (+)= sum over kept blocks j in [j0, j1) of hid pairs x the block's down pairs,
// for column vectors cv in [cv0, cv1). hid pairs [nt, hs]; block j's pairs start at j * kPairs.
void down_portable(const uint32_t* hid, int64_t nt, int64_t hs, const uint32_t* wd, const int32_t* idx, int64_t j0,
                   int64_t j1, int64_t num_cv, int64_t cv0, int64_t cv1, bool accumulate, float* out, int64_t h) {
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t cv = cv0; cv < cv1; ++cv) {
      float acc[kBlock];
      for (int64_t l = 0; l < kBlock; ++l) acc[l] = accumulate ? out[t * h + cv * kBlock + l] : 0.f;
      for (int64_t j = j0; j < j1; ++j) {
        const uint32_t* wb = wd + (idx[j] * num_cv + cv) * kPairs * kBlock;
        for (int64_t p = 0; p < kPairs; ++p) {
          const uint32_t a = hid[t * hs + j * kPairs + p];
          for (int64_t l = 0; l < kBlock; ++l)
            acc[l] += bf16_lo(wb[p * kBlock + l]) * bf16_lo(a) + bf16_hi(wb[p * kBlock + l]) * bf16_hi(a);
        }
      }
      std::copy_n(acc, kBlock, out + t * h + cv * kBlock);
    }
}

}  // namespace
}  // namespace sparsever::cpu

// ---- AVX512-BF16 kernels (vdpbf16ps), compiled into the AVX-512 build only --------------------------
#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace sparsever::cpu {
namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

template <int NT>
inline void block_dot_tile_bf16(const uint32_t* x, int64_t hp, const uint32_t* w, float* y, int64_t ys) {
  // Two accumulators per token (even/odd pairs) so consecutive vdpbf16ps do not wait on each other.
  __m512 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= hp; p += 2) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(w + p * kBlock));
    const __m512bh w1 = as_bh(_mm512_loadu_si512(w + (p + 1) * kBlock));
    for (int t = 0; t < NT; ++t) {
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, as_bh(_mm512_set1_epi32(static_cast<int>(x[t * hp + p]))));
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, as_bh(_mm512_set1_epi32(static_cast<int>(x[t * hp + p + 1]))));
    }
  }
  if (p < hp) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(w + p * kBlock));
    for (int t = 0; t < NT; ++t)
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, as_bh(_mm512_set1_epi32(static_cast<int>(x[t * hp + p]))));
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(y + t * ys, _mm512_add_ps(acc[t][0], acc[t][1]));
}

void block_dot_bf16(const uint32_t* x, int64_t nt, int64_t hp, const uint32_t* w, float* y, int64_t ys) {
  int64_t t = 0;
  for (; t + kTokTile <= nt; t += kTokTile) block_dot_tile_bf16<kTokTile>(x + t * hp, hp, w, y + t * ys, ys);
  switch (nt - t) {
    case 3: block_dot_tile_bf16<3>(x + t * hp, hp, w, y + t * ys, ys); break;
    case 2: block_dot_tile_bf16<2>(x + t * hp, hp, w, y + t * ys, ys); break;
    case 1: block_dot_tile_bf16<1>(x + t * hp, hp, w, y + t * ys, ys); break;
    default: break;
  }
}

template <int NT, int NV>
inline void down_tile_bf16(const uint32_t* hid, int64_t hs, const uint32_t* wd, const int32_t* idx, int64_t j0,
                           int64_t j1, int64_t num_cv, int64_t cv, bool accumulate, float* out, int64_t h) {
  __m512 acc[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v)
      acc[t][v] = accumulate ? _mm512_loadu_ps(out + t * h + (cv + v) * kBlock) : _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    // NV consecutive column vectors of one block are NV * 512 contiguous bytes.
    const uint32_t* wb = wd + (idx[j] * num_cv + cv) * kPairs * kBlock;
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh a[NT];
      for (int t = 0; t < NT; ++t) a[t] = as_bh(_mm512_set1_epi32(static_cast<int>(hid[t * hs + j * kPairs + p])));
      for (int v = 0; v < NV; ++v) {
        const __m512bh wv = as_bh(_mm512_loadu_si512(wb + (v * kPairs + p) * kBlock));
        for (int t = 0; t < NT; ++t) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], wv, a[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + t * h + (cv + v) * kBlock, acc[t][v]);
}

template <int NV>
inline void down_chunk_bf16(const uint32_t* hid, int64_t nt, int64_t hs, const uint32_t* wd, const int32_t* idx,
                            int64_t j0, int64_t j1, int64_t num_cv, int64_t cv, bool acc, float* out, int64_t h) {
  int64_t t = 0;
  for (; t + kTokTile <= nt; t += kTokTile)
    down_tile_bf16<kTokTile, NV>(hid + t * hs, hs, wd, idx, j0, j1, num_cv, cv, acc, out + t * h, h);
  switch (nt - t) {
    case 3: down_tile_bf16<3, NV>(hid + t * hs, hs, wd, idx, j0, j1, num_cv, cv, acc, out + t * h, h); break;
    case 2: down_tile_bf16<2, NV>(hid + t * hs, hs, wd, idx, j0, j1, num_cv, cv, acc, out + t * h, h); break;
    case 1: down_tile_bf16<1, NV>(hid + t * hs, hs, wd, idx, j0, j1, num_cv, cv, acc, out + t * h, h); break;
    default: break;
  }
}

void down_bf16(const uint32_t* hid, int64_t nt, int64_t hs, const uint32_t* wd, const int32_t* idx, int64_t j0,
               int64_t j1, int64_t num_cv, int64_t cv0, int64_t cv1, bool acc, float* out, int64_t h) {
  for (int64_t cv = cv0; cv < cv1; cv += kColVecs) {
    switch (std::min<int64_t>(kColVecs, cv1 - cv)) {
      case 4: down_chunk_bf16<4>(hid, nt, hs, wd, idx, j0, j1, num_cv, cv, acc, out, h); break;
      case 3: down_chunk_bf16<3>(hid, nt, hs, wd, idx, j0, j1, num_cv, cv, acc, out, h); break;
      case 2: down_chunk_bf16<2>(hid, nt, hs, wd, idx, j0, j1, num_cv, cv, acc, out, h); break;
      default: down_chunk_bf16<1>(hid, nt, hs, wd, idx, j0, j1, num_cv, cv, acc, out, h); break;
    }
  }
}

}  // namespace
}  // namespace sparsever::cpu
#pragma GCC pop_options
#endif  // CPU_CAPABILITY_AVX512

namespace sparsever::cpu {
namespace {

using BlockDotFn = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, float*, int64_t);
using DownFn = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, const int32_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, bool, float*, int64_t);

bool cpu_has_avx512_bf16() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

struct Kernels {
  BlockDotFn block_dot;
  DownFn down;
};

Kernels kernels() {
#if defined(CPU_CAPABILITY_AVX512)
  if (cpu_has_avx512_bf16()) return {&block_dot_bf16, &down_bf16};
#endif
  return {&block_dot_portable, &down_portable};
}

// Indices of the k largest scores (lower index wins ties), ascending.
void topk_blocks(const float* scores, int64_t n, int64_t k, int32_t* dst) {
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
  std::sort(order.begin(), order.begin() + k);
  std::copy(order.begin(), order.begin() + k, dst);
}

// y[t, b*16 + i] for the blocks blk(j), j in [0, nblocks) (blk = idx or identity), parallel over blocks.
void blocks_dot(const Kernels& kern, const uint32_t* x, int64_t nt, int64_t hp, const uint32_t* w,
                const int32_t* idx, int64_t nblocks, float* y, int64_t ys) {
  const int64_t block_words = hp * kBlock;
  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      kern.block_dot(x, nt, hp, w + (idx ? idx[j] : j) * block_words, y + j * kBlock, ys);
  });
}

// out[t, :] = sum over kept blocks of hid x down rows. Each thread owns a slab of column vectors and walks
// the kept blocks kDownBlocks at a time, prefetching the next pass's slab of each block (contiguous).
void blocks_down(const Kernels& kern, const uint32_t* hid, int64_t nt, int64_t kb, const uint32_t* wd,
                 const int32_t* idx, int64_t h, float* out) {
  const int64_t num_cv = h / kBlock;
  const int64_t slabs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_cv / kColVecs));
  const int64_t per_slab = (num_cv + slabs - 1) / slabs;
  const int64_t hs = kb * kPairs;
  at::parallel_for(0, slabs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t cv0 = s * per_slab, cv1 = std::min(num_cv, cv0 + per_slab);
      if (cv0 >= cv1) continue;
      const int64_t slab_bytes = (cv1 - cv0) * kPairs * kBlock * 4;
      for (int64_t j0 = 0; j0 < kb; j0 += kDownBlocks) {
        const int64_t j1 = std::min(kb, j0 + kDownBlocks);
        for (int64_t jn = j1; jn < std::min(kb, j1 + kDownBlocks); ++jn) {
          const char* p = reinterpret_cast<const char*>(wd + (idx[jn] * num_cv + cv0) * kPairs * kBlock);
          for (int64_t b = 0; b < slab_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
        }
        kern.down(hid, nt, hs, wd, idx, j0, j1, num_cv, cv0, cv1, j0 > 0, out, h);
      }
    }
  });
}

}  // namespace
}  // namespace sparsever::cpu

using namespace sparsever::cpu;

std::string ffn_packed_isa() { return cpu_has_avx512_bf16() ? "avx512_bf16" : "portable"; }

void topk_block_swiglu_ffn_cpu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w_gate_p,
                               const torch::Tensor& w_up_p, const torch::Tensor& w_down_p,
                               const torch::Tensor& group_start_loc, int64_t keep_blocks, torch::Tensor& selected) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w_gate_p.scalar_type() == at::kBFloat16 &&
                  w_up_p.scalar_type() == at::kBFloat16 && w_down_p.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "topk_block_swiglu_ffn: x, out and the packed weights must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x/out must be contiguous [T, H]");
  const int64_t num_tokens = x.size(0), h = x.size(1);
  TORCH_CHECK(h % kBlock == 0, "hidden size must be a multiple of 16");
  const int64_t nb = w_gate_p.size(0), hp = h / 2, num_cv = h / kBlock;
  TORCH_CHECK(w_gate_p.dim() == 4 && w_gate_p.size(1) == hp && w_gate_p.size(2) == kBlock && w_gate_p.size(3) == 2 &&
                  w_gate_p.is_contiguous(),
              "w_gate_p must be contiguous [nb, H/2, 16, 2]");
  TORCH_CHECK(w_up_p.sizes() == w_gate_p.sizes() && w_up_p.is_contiguous(), "w_up_p must match w_gate_p");
  TORCH_CHECK(w_down_p.dim() == 5 && w_down_p.size(0) == nb && w_down_p.size(1) == num_cv &&
                  w_down_p.size(2) == kPairs && w_down_p.size(3) == kBlock && w_down_p.size(4) == 2 &&
                  w_down_p.is_contiguous(),
              "w_down_p must be contiguous [nb, H/16, 8, 16, 2]");
  TORCH_CHECK(keep_blocks >= 1 && keep_blocks <= nb, "keep_blocks must be in [1, ", nb, "]");
  const int64_t num_groups = group_start_loc.size(0) - 1;
  TORCH_CHECK(selected.scalar_type() == at::kInt && selected.size(0) == num_groups &&
                  selected.size(1) == keep_blocks && selected.is_contiguous(),
              "selected must be int32 [G, keep_blocks]");
  TORCH_CHECK(group_start_loc.scalar_type() == at::kInt, "group_start_loc must be int32");
  auto gsl_t = group_start_loc.contiguous();
  const int32_t* gsl = gsl_t.data_ptr<int32_t>();
  const Kernels kern = kernels();
  const int64_t inter = nb * kBlock;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* wg = reinterpret_cast<const uint32_t*>(w_gate_p.data_ptr<at::BFloat16>());
  const auto* wu = reinterpret_cast<const uint32_t*>(w_up_p.data_ptr<at::BFloat16>());
  const auto* wd = reinterpret_cast<const uint32_t*>(w_down_p.data_ptr<at::BFloat16>());
  int32_t* sel = selected.data_ptr<int32_t>();
  auto* op = out.data_ptr<at::BFloat16>();

  // Dense gate for every token (the scores need it), then silu in place.
  std::vector<float> act(static_cast<size_t>(num_tokens * inter));
  blocks_dot(kern, xp, num_tokens, hp, wg, nullptr, nb, act.data(), inter);
  silu_inplace(act.data(), num_tokens * inter);

  std::vector<float> block_scores(nb), up, out_f(static_cast<size_t>(h) * std::max<int64_t>(num_tokens, 1));
  std::vector<uint32_t> hid;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t t0 = gsl[g], nt = gsl[g + 1] - gsl[g];
    int32_t* idx = sel + g * keep_blocks;
    if (nt <= 0) {
      std::fill(idx, idx + keep_blocks, -1);
      continue;
    }
    // Block score = sum over its neurons and the group's tokens of |silu(gate)|.
    std::fill(block_scores.begin(), block_scores.end(), 0.f);
    for (int64_t t = t0; t < t0 + nt; ++t) {
      const float* a = act.data() + t * inter;
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) s += std::abs(a[b * kBlock + i]);
        block_scores[b] += s;
      }
    }
    topk_blocks(block_scores.data(), nb, keep_blocks, idx);
    const int64_t kn = keep_blocks * kBlock;
    up.resize(static_cast<size_t>(nt * kn));
    blocks_dot(kern, xp + t0 * hp, nt, hp, wu, idx, keep_blocks, up.data(), kn);
    // SwiGLU product, rounded to bf16 pairs for the down projection (as a bf16 MLP rounds its activation).
    hid.resize(static_cast<size_t>(nt * kn / 2));
    for (int64_t t = 0; t < nt; ++t) {
      const float* a = act.data() + (t0 + t) * inter;
      for (int64_t j = 0; j < keep_blocks; ++j)
        for (int64_t p = 0; p < kPairs; ++p) {
          const int64_t n = idx[j] * kBlock + 2 * p, u = t * kn + j * kBlock + 2 * p;
          hid[t * (kn / 2) + j * kPairs + p] = bf16_pair(a[n] * up[u], a[n + 1] * up[u + 1]);
        }
    }
    blocks_down(kern, hid.data(), nt, keep_blocks, wd, idx, h, out_f.data());
    for (int64_t t = 0; t < nt; ++t) store_from_f32<at::BFloat16>(out_f.data() + t * h, op + (t0 + t) * h, h);
  }
}
