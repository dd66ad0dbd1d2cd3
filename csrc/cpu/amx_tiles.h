// AMX (Advanced Matrix Extensions) tiles for the AVX-512 module: a tile configuration, the process's
// permission to use tile data, and two tile backends with one interface, so each kernel's tile code is
// written once as a template over the backend:
//   Hardware  the AMX instructions (callers check amx_usable() first);
//   Emulated  a software model of the same eight tiles, per thread, for tests: with
//             SPARSEVER_CPU_AMX_EMULATE=1 the AMX paths run on it on any CPU with AVX512-BF16, so they
//             are checked against the references on CPUs without AMX (as the SIMT executor runs the CUDA
//             kernels' bodies), and misuse the hardware would fault on is reported as an error.
//             Its prefetch() also logs the line, so tests see whether tile loads later read it.
// The functions carry their own target attribute, so the rest of the module needs no AMX flags.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>
#include <cpuid.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "gemv_rows_bf16.h"  // rows_bf16_available

// Every CPU with AMX-BF16 also has AVX512-BF16 (amx_usable checks both): its vcvtne2ps2bf16 rounds the
// softmax's probabilities to bf16 in one instruction.
#define SPARSEVER_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace sparsever::cpu::amx {

constexpr int kTiles = 8;          // palette 1
constexpr int kTileRows = 16;      // rows of an A or C tile (query rows)
constexpr int kTileBytes = 64;     // bytes per tile row
constexpr int kBf16PerRow = 32;    // bf16 values per tile row: the K depth of one tile product
constexpr int kF32PerRow = 16;     // fp32 values per C tile row: the N width of one tile product

// True when the CPU has AMX-TILE and AMX-BF16 (CPUID.(7,0):EDX bits 24 and 22) and the kernel granted
// this process tile data (at::cpu::init_amx, once per process).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool has = (edx >> 24 & 1u) && (edx >> 22 & 1u);  // AMX-TILE, AMX-BF16
    return has && rows_bf16_available() && at::cpu::init_amx();
  }();
  return ok;
}

// SPARSEVER_CPU_AMX_EMULATE=1 (read per op call, so tests can set it): the AMX paths run on Emulated
// tiles, on CPUs with AMX too (to compare the two). The paths' vector work needs AVX512-BF16.
inline bool emulation_enabled() {
  const char* env = std::getenv("SPARSEVER_CPU_AMX_EMULATE");
  return env != nullptr && std::strcmp(env, "1") == 0 && rows_bf16_available();
}

// Whether an op's AMX paths run at all (on either backend).
inline bool tiles_usable(bool emulate) { return emulate || amx_usable(); }

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The instructions, one per member: tile numbers are template arguments, as the instructions encode them
// (the same encodings as GCC's _tile_* intrinsics, which take only literal numbers).
struct Hardware {
  SPARSEVER_AMX static void configure(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
  SPARSEVER_AMX static void release() { _tile_release(); }
  template <int T>
  SPARSEVER_AMX static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  SPARSEVER_AMX static void load(const void* src, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(src), "r"(static_cast<long>(stride)), "i"(T));
  }
  template <int T>
  SPARSEVER_AMX static void store(void* dst, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(dst), "r"(static_cast<long>(stride)), "i"(T) : "memory");
  }
  // C += A B: fp32 C [rows, N] += bf16 A [rows, 2K] x bf16 B [K pairs, N x 2] (B's rows hold pairs
  // along the reduction).
  template <int C, int A, int B>
  SPARSEVER_AMX static void dot_bf16() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  // A software prefetch (into L2) of the line at p, for a tile load to come.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};

// The tiles in software, per thread (a thread's tile registers): the Intel SDM's semantics of
// LDTILECFG (all tiles zeroed), TILELOADD / TILESTORED (rows x colsb bytes; the rest of a loaded tile
// zeroed), TILEZERO and TDPBF16PS (per row of C, for each pair k, for each column n: two fp32 adds of
// exact bf16 products, in that order, round to nearest even, denormals flushed on input and output).
// A tile used unconfigured, or a product of mismatched shapes (#UD on the hardware), throws.
struct Emulated {
  struct File {
    bool configured = false;
    uint8_t rows[kTiles] = {};
    uint16_t colsb[kTiles] = {};
    alignas(64) uint8_t data[kTiles][kTileRows * kTileBytes] = {};
  };
  static File& file() {
    static thread_local File f;
    return f;
  }
  // TDPBF16PS run in this process (tests: that the AMX path ran, not a fallback).
  static std::atomic<int64_t>& products() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  // Lines prefetched through prefetch() in this process, and how many of them a tile load of the same
  // thread read at least kPrefetchLead tile loads later (tests: that a prefetch schedule fetches the
  // lines the tiles read, well before they read them).
  static constexpr int64_t kPrefetchLead = 16;
  static std::atomic<int64_t>& prefetched_lines() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  static std::atomic<int64_t>& prefetched_lines_loaded() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  static void prefetch(const void* p) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
    if (pending_lines().emplace(reinterpret_cast<uintptr_t>(p) / kTileBytes, tile_loads()).second)
      prefetched_lines().fetch_add(1);
  }
  static void configure(const TileConfig& cfg) {
    TORCH_CHECK(cfg.palette_id == 1, "AMX emulation: palette ", int(cfg.palette_id), " (only palette 1)");
    File& f = file();
    for (int t = 0; t < kTiles; ++t) {
      TORCH_CHECK(cfg.rows[t] <= kTileRows && cfg.colsb[t] <= kTileBytes && (cfg.rows[t] == 0) == (cfg.colsb[t] == 0),
                  "AMX emulation: tile ", t, " configured as ", int(cfg.rows[t]), " rows x ", cfg.colsb[t], " bytes");
      f.rows[t] = cfg.rows[t];
      f.colsb[t] = cfg.colsb[t];
    }
    std::memset(f.data, 0, sizeof(f.data));
    f.configured = true;
  }
  static void release() {
    File& f = file();
    f.configured = false;
    std::memset(f.data, 0, sizeof(f.data));
    pending_lines().clear();
  }
  template <int T>
  static void zero() {
    std::memset(tile(T), 0, kTileRows * kTileBytes);
  }
  template <int T>
  static void load(const void* src, int64_t stride) {
    uint8_t* d = tile(T);
    const File& f = file();
    std::memset(d, 0, kTileRows * kTileBytes);
    auto& pending = pending_lines();
    const int64_t now = tile_loads()++;
    for (int r = 0; r < f.rows[T]; ++r) {
      const uint8_t* row = static_cast<const uint8_t*>(src) + r * stride;
      std::memcpy(d + r * kTileBytes, row, f.colsb[T]);
      if (pending.empty()) continue;
      const uintptr_t first = reinterpret_cast<uintptr_t>(row) / kTileBytes;
      const uintptr_t last = (reinterpret_cast<uintptr_t>(row) + f.colsb[T] - 1) / kTileBytes;
      for (uintptr_t line = first; line <= last; ++line) {
        const auto it = pending.find(line);
        if (it == pending.end()) continue;
        if (now - it->second >= kPrefetchLead) prefetched_lines_loaded().fetch_add(1);
        pending.erase(it);
      }
    }
  }
  template <int T>
  static void store(void* dst, int64_t stride) {
    const uint8_t* s = tile(T);
    const File& f = file();
    for (int r = 0; r < f.rows[T]; ++r) std::memcpy(static_cast<uint8_t*>(dst) + r * stride, s + r * kTileBytes, f.colsb[T]);
  }
  template <int C, int A, int B>
  static void dot_bf16() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS needs three distinct tiles");
    float* c = reinterpret_cast<float*>(tile(C));
    const uint16_t* a = reinterpret_cast<const uint16_t*>(tile(A));
    const uint16_t* b = reinterpret_cast<const uint16_t*>(tile(B));
    const File& f = file();
    const int m_rows = f.rows[C], n = f.colsb[C] / 4, k_pairs = f.colsb[A] / 4;
    TORCH_CHECK(f.rows[A] == m_rows && f.rows[B] == k_pairs && f.colsb[B] == f.colsb[C] && f.colsb[A] % 4 == 0,
                "AMX emulation: TDPBF16PS on tiles C ", C, " (", m_rows, " x ", f.colsb[C], " B), A ", A, " (",
                int(f.rows[A]), " x ", f.colsb[A], " B), B ", B, " (", int(f.rows[B]), " x ", f.colsb[B], " B)");
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
    for (int m = 0; m < m_rows; ++m) {
      float* crow = c + m * kF32PerRow;
      for (int k = 0; k < k_pairs; ++k) {
        const float a0 = widen(a[m * kBf16PerRow + 2 * k]), a1 = widen(a[m * kBf16PerRow + 2 * k + 1]);
        const uint16_t* brow = b + k * kBf16PerRow;
        for (int j = 0; j < n; ++j) {
          crow[j] += a0 * widen(brow[2 * j]);
          crow[j] += a1 * widen(brow[2 * j + 1]);
        }
      }
    }
    _mm_setcsr(csr);
    products().fetch_add(1, std::memory_order_relaxed);
  }

 private:
  static float widen(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
  // Lines (address / 64) prefetched by this thread and not yet tile-loaded, with the thread's count
  // of tile loads when each was prefetched.
  static std::unordered_map<uintptr_t, int64_t>& pending_lines() {
    static thread_local std::unordered_map<uintptr_t, int64_t> lines;
    return lines;
  }
  static int64_t& tile_loads() {
    static thread_local int64_t n = 0;
    return n;
  }
  static uint8_t* tile(int t) {
    File& f = file();
    TORCH_CHECK(f.configured && f.rows[t] > 0, "AMX emulation: tile ", t, " used but not configured");
    return f.data[t];
  }
};

// The 2x2 register pattern every attention kernel here uses: A tiles 0 and 1 (row groups a and b, m0 and
// m1 rows), B tiles 2 and 3 (16 rows of 64 bytes), C tiles 4/5 (row group a x B 2/3) and 6/7 (row
// group b). m1 == 0 leaves tiles 1, 6 and 7 unconfigured (single row group).

// The 2x2 pattern's C tiles: 4/5 = row group a at columns [0, 16) and [16, 32) of `c`, 6/7 = row group b
// (`two`), 16 rows on; `stride` in bytes between rows.
template <typename Tiles>
SPARSEVER_AMX inline void zero_c_tiles(bool two) {
  Tiles::template zero<4>();
  Tiles::template zero<5>();
  if (two) {
    Tiles::template zero<6>();
    Tiles::template zero<7>();
  }
}
template <typename Tiles>
SPARSEVER_AMX inline void load_c_tiles(const float* c, int64_t stride, bool two) {
  Tiles::template load<4>(c, stride);
  Tiles::template load<5>(c + 16, stride);
  if (two) {
    const float* b = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c) + 16 * stride);
    Tiles::template load<6>(b, stride);
    Tiles::template load<7>(b + 16, stride);
  }
}
template <typename Tiles>
SPARSEVER_AMX inline void store_c_tiles(float* c, int64_t stride, bool two) {
  Tiles::template store<4>(c, stride);
  Tiles::template store<5>(c + 16, stride);
  if (two) {
    float* b = reinterpret_cast<float*>(reinterpret_cast<char*>(c) + 16 * stride);
    Tiles::template store<6>(b, stride);
    Tiles::template store<7>(b + 16, stride);
  }
}

// C += A B over one 32-deep slice: A tiles 0/1 = rows of `a` (row group b 16 rows on, `a_stride` bytes
// apart), B tiles 2/3 from b0 and b1 (16 rows of 64 bytes each: pairs along the reduction).
template <typename Tiles>
SPARSEVER_AMX inline void dp_2x2(const void* a, int64_t a_stride, bool two, const void* b0, const void* b1) {
  Tiles::template load<0>(a, a_stride);
  Tiles::template load<2>(b0, kTileBytes);
  Tiles::template load<3>(b1, kTileBytes);
  Tiles::template dot_bf16<4, 0, 2>();
  Tiles::template dot_bf16<5, 0, 3>();
  if (two) {
    Tiles::template load<1>(static_cast<const char*>(a) + 16 * a_stride, a_stride);
    Tiles::template dot_bf16<6, 1, 2>();
    Tiles::template dot_bf16<7, 1, 3>();
  }
}

template <typename Tiles>
class TileState {
 public:
  // Loads the configuration for row groups of m0 and m1 rows unless it is already in place.
  // Construct one per parallel chunk: other code on the thread (oneDNN) may load its own.
  SPARSEVER_AMX void configure(int m0, int m1) {
    if (m0 == m0_ && m1 == m1_) return;
    TileConfig cfg;
    const int rows[8] = {m0, m1, kTileRows, kTileRows, m0, m0, m1, m1};
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(rows[t]);
      cfg.colsb[t] = rows[t] > 0 ? kTileBytes : 0;
    }
    Tiles::configure(cfg);
    m0_ = m0;
    m1_ = m1;
  }
  SPARSEVER_AMX ~TileState() {
    if (m0_ >= 0) Tiles::release();
  }

 private:
  int m0_ = -1, m1_ = -1;
};

}  // namespace sparsever::cpu::amx
#endif
