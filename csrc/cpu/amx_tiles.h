// AMX (Advanced Matrix Extensions) tile helpers for the AVX-512 module: a tile configuration, the
// process's permission to use tile data, and bf16 tile GEMM steps. Callers check `amx_usable()` first;
// the functions carry their own target attribute, so the rest of the module needs no AMX flags.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/cpu/Utils.h>
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// Every CPU with AMX-BF16 also has AVX512-BF16 (amx_usable checks both): its vcvtne2ps2bf16 rounds the
// softmax's probabilities to bf16 in one instruction.
#define SPARSEVER_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace sparsever::cpu::amx {

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
    unsigned eax1 = 0, ebx1 = 0, ecx1 = 0, edx1 = 0;
    const bool bf16 = __get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1) && (eax1 >> 5 & 1u);  // AVX512-BF16
    return has && bf16 && at::cpu::init_amx();
  }();
  return ok;
}

// The 2x2 register pattern every kernel here uses: A tiles 0 and 1 (row groups a and b, m0 and m1
// rows), B tiles 2 and 3 (16 rows of 64 bytes), C tiles 4/5 (row group a x B 2/3) and 6/7 (row
// group b). m1 == 0 leaves tiles 1, 6 and 7 unconfigured (single row group).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The 2x2 pattern's C tiles: 4/5 = row group a at columns [0, 16) and [16, 32) of `c`, 6/7 = row group b
// (`two`), 16 rows on; `stride` in bytes between rows.
SPARSEVER_AMX inline void zero_c_tiles(bool two) {
  _tile_zero(4);
  _tile_zero(5);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
}
SPARSEVER_AMX inline void load_c_tiles(const float* c, int64_t stride, bool two) {
  _tile_loadd(4, c, stride);
  _tile_loadd(5, c + 16, stride);
  if (two) {
    const float* b = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c) + 16 * stride);
    _tile_loadd(6, b, stride);
    _tile_loadd(7, b + 16, stride);
  }
}
SPARSEVER_AMX inline void store_c_tiles(float* c, int64_t stride, bool two) {
  _tile_stored(4, c, stride);
  _tile_stored(5, c + 16, stride);
  if (two) {
    float* b = reinterpret_cast<float*>(reinterpret_cast<char*>(c) + 16 * stride);
    _tile_stored(6, b, stride);
    _tile_stored(7, b + 16, stride);
  }
}

// C += A B over one 32-deep slice: A tiles 0/1 = rows of `a` (row group b 16 rows on, `a_stride` bytes
// apart), B tiles 2/3 from b0 and b1 (16 rows of 64 bytes each: pairs along the reduction).
SPARSEVER_AMX inline void dp_2x2(const void* a, int64_t a_stride, bool two, const void* b0, const void* b1) {
  _tile_loadd(0, a, a_stride);
  _tile_loadd(2, b0, kTileBytes);
  _tile_loadd(3, b1, kTileBytes);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(5, 0, 3);
  if (two) {
    _tile_loadd(1, static_cast<const char*>(a) + 16 * a_stride, a_stride);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

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
    _tile_loadconfig(&cfg);
    m0_ = m0;
    m1_ = m1;
  }
  SPARSEVER_AMX ~TileState() {
    if (m0_ >= 0) _tile_release();
  }

 private:
  int m0_ = -1, m1_ = -1;
};

}  // namespace sparsever::cpu::amx
#endif
