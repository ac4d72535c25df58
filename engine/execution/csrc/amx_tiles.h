// What the engine's AMX kernels share (csrc/cpu_amx_gemm.cpp's linear layers, csrc/cpu_moe.cpp's experts): asking
// Linux for the tile state, the tile configuration record, and rounding a C tile row's 16 float32 results to
// bfloat16. SHOAL_AMX is defined only where the tier's flags enable the tiles (-mamx-tile -mamx-bf16) and
// AVX512-BF16; elsewhere this header defines only the weight layout's block sizes (the ops' shape checks use them).
#pragma once

#include <cstdint>

namespace shoal_amx {
constexpr int64_t kK = 32;           // input features per weight block (a tile row of bfloat16)
constexpr int64_t kN = 16;           // output features per weight block
constexpr int64_t kBlock = kN * kK;  // bfloat16 per weight block (1 KiB)
}  // namespace shoal_amx

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SHOAL_AMX 1
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace shoal_amx {

// Linux gives a process the tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); the grant
// is per process, so asking again from another kernel library is harmless.
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int rows_, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(rows_ ? bytes_per_row : 0);
  }

  // ldtilecfg. The empty asm tells the compiler the record is read here: GCC 12 otherwise drops the stores set()
  // made before its ldtilecfg builtin (seen: a config of zeros loaded, and SIGILL at the first tile instruction).
  void load() const {
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};

// 16 float32 results (+ bias, bfloat16) rounded to bfloat16, nearest even, as c10::BFloat16 rounds.
inline void store16(const float* c, const c10::BFloat16* bias, c10::BFloat16* y) {
  __m512 v = _mm512_loadu_ps(c);
  if (bias) v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bias)), 16)));
  _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(v));
}

// The same 16 results as float32 values: rounded to bfloat16 first, so they equal the bfloat16 store widened (an LM
// head's float32 logits without a bfloat16 copy and a conversion pass).
inline void store16(const float* c, const c10::BFloat16* bias, float* y) {
  alignas(64) c10::BFloat16 b[16];
  store16(c, bias, b);
  _mm512_storeu_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)b)), 16)));
}

// Scratch kept between calls (a fresh buffer of a prefill's size costs its page faults every layer), but not beyond
// 64 MiB: one long prompt's rows must not stay held for the process's life.
template <typename T>
inline void trim_scratch(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > (size_t(64) << 20)) std::vector<T>().swap(v);
}

// Tile epilogues, 16 lanes at a time. v rounded to bfloat16 (nearest even) and widened back to float32.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// 16 bfloat16 widened to float32.
inline __m512 load_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// e^x lane by lane: fast_math.h's exp_approx (the same clamps, rounding and polynomial, so the same bits).
inline __m512 exp_approx(__m512 x) {
  __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace shoal_amx
#endif
