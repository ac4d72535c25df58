// Dot products against GGUF-quantized weight rows kept in ggml's block format, for one CPU tier per build.
// No torch here: layers/csrc/cpu_gguf.cpp (the matmul op) and layers/csrc/cpu_moe.cpp (packed expert stacks) wrap
// it, and tests/engine/gguf_kernel_driver.cpp builds it alone for ARM64 to run under emulation.
//
// Block layouts (little-endian; d, dmin and m are IEEE fp16):
//   Q8_0 (34 B / 32): d, int8 q[32]                                      w = d q
//   Q4_0 (18 B / 32): d, q[16] (low nibbles: weights 0-15, high: 16-31)  w = d (q - 8)
//   Q4_1 (20 B / 32): d, m, q[16] (the same nibble order)                w = d q + m
//   Q4_K (144 B / 256): d, dmin, 12 bytes of 6-bit (scale, min) for 8 groups of 32, q[128]; each 32 bytes of q hold
//                       two groups (low nibbles, then high)              w = d sc q - dmin mn
//   Q6_K (210 B / 256): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16 weights), d
//                                                                        w = d sc (q - 32)
//
// Every type is read 32 weights at a time: its quants are unpacked in registers into 32 small integers (two 16-byte
// vectors; all fit int8: Q4 0..15, Q6_K -32..31, Q8_0 itself), widened to int16 and multiplied with the activations
// quantized to int16 per group of 32 (see quantize_row): an exact integer dot product, scaled once per group (per
// 16 for Q6_K).
//
// The vector layer has one implementation per ISA, chosen by the build's flags (engine/execution/cpu_features.py):
// AVX2 (vpmaddwd; vpdpwssd where the tier has AVX512-VNNI), NEON (widening multiply-accumulate; also the SVE tier's
// build) and portable loops for everything else. The integer sums are exact and equal on every tier; only the order
// of the float accumulation differs.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SHOAL_GGUF_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_GGUF_AVX2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define SHOAL_GGUF_NEON 1
#endif

namespace shoal_gguf {

enum QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // ggml's type ids

struct Format {
  int block;  // weights per block
  int bytes;  // bytes per block
};

// {0, 0} for a type this file does not run.
inline Format format_of(int qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  return {0, 0};
}

inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return fp16_to_float(v);
}

// The 6-bit scale and min of Q4_K group j (0..7) from its 12 packed bytes.
inline void q4k_scale_min(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block into out[block], rounded exactly as the gguf package's dequantization (the tests' reference).
inline void dequantize_block(int qtype, const uint8_t* b, float* out) {
  switch (qtype) {
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * q[j];
      return;
    }
    case Q4_0:
    case Q4_1: {
      const float d = half_at(b);
      const float c = qtype == Q4_1 ? half_at(b + 2) : -8.0f * d;
      const uint8_t* q = b + (qtype == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (q[j] & 0x0F) + c;
        out[j + 16] = d * (q[j] >> 4) + c;
      }
      return;
    }
    case Q4_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* q = b + 16;
      for (int j = 0; j < 8; j += 2, q += 32) {
        int sc0, mn0, sc1, mn1;
        q4k_scale_min(j, b + 4, &sc0, &mn0);
        q4k_scale_min(j + 1, b + 4, &sc1, &mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
        for (int l = 0; l < 32; ++l) {
          out[j * 32 + l] = d0 * (q[l] & 0x0F) - m0;
          out[j * 32 + 32 + l] = d1 * (q[l] >> 4) - m1;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int half = 0; half < 2; ++half, out += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          out[l] = d * sc[is] * (((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
          out[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
          out[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          out[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      return;
    }
  }
}

// ------------------------------------------------------------------------------------- 16-bit activations
// Decode-sized batches quantize each activation row per group of 32 to int16: q = round(x / d), d = max|x| / 32767.
// Each weight group's dot product is then an exact integer sum, scaled once by (weight scale) * d; a float weight
// would cost a conversion per weight instead. The rounding error is at most d / 2 per activation (2^-16 of the
// group's largest), which bounds a row's error by sum over groups of d_g / 2 * sum |w| (the tests check exactly
// that). Offsets that do not depend on the weight (Q4_1's m, Q4_K's dmin mn) multiply the group's exact float sum.
// 8-bit groups, as llama.cpp's q8_1 blocks, would be ~20% faster here but were measured 0.23 nats (median) off the
// dequantized model on SmolLM2-135M Q4_1 (twice bfloat16's own error), changing every greedy continuation; 16-bit
// groups are 0.001 off and change none.

using QAct = int16_t;               // an activation quantized to kQMax steps
constexpr float kQMax = 32767.0f;

struct QRows {     // MR activation rows, quantized
  const QAct* q;    // [MR, ld * 32]
  const float* ds;  // [MR, ld, 2]: per group of 32, its scale d and the exact float sum of its activations
  int64_t ld;       // groups per row (K / 32)
};

// One row of K activations (K a multiple of 32) into q[K] and ds[K / 16]. Plain loops: every tier rounds
// identically (nearest, ties to even), so the integer sums are the same on every CPU.
inline void quantize_row(const float* x, int64_t K, QAct* q, float* ds) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* xg = x + g * 32;
    float amax = 0.0f, s = 0.0f;
    for (int j = 0; j < 32; ++j) {
      const float a = xg[j] < 0 ? -xg[j] : xg[j];
      amax = a > amax ? a : amax;
      s += xg[j];
    }
    const float dg = amax / kQMax, inv = amax > 0.0f ? kQMax / amax : 0.0f;
    for (int j = 0; j < 32; ++j) q[g * 32 + j] = static_cast<QAct>(__builtin_nearbyintf(xg[j] * inv));
    ds[2 * g] = dg;
    ds[2 * g + 1] = s;
  }
}

// ------------------------------------------------------------------------------------------------ vector layer
// B16: 16 bytes of a block. ld16(p) | lo4(v) = v & 15 | hi4(v) = v >> 4 | bits2<S>(v) = (v >> S) & 3 |
//   or_shl4(a, b) = a | b << 4 (b <= 3) | sub(v, k)
// W16: 16 weights as int16. widen(b) (bytes as int8) | nibbles(raw, lo, hi): the low and the high nibbles of 16 bytes
// VI: integer lanes. dot16(w, x) = the products of 16 weights with 16 int16 activations, summed into lanes;
//   dot32(w0, w1, x) the same over a group's 32 (exact: |w x| < 2^22)
// VF: float accumulator. fmadd(s, v, acc) = acc + s * v | hsum(acc)
// S2: a pair of floats. mul_halves(p, f) = (fp16 p[0] * f[0], fp16 p[1] * f[1]): Q4_1's (d, m) times the group's
//   (d, sum) in one conversion and one multiply | fmadd_first(s, v, acc) = acc + s.first * v | add2 | second(s)

#if defined(SHOAL_GGUF_AVX512) || defined(SHOAL_GGUF_AVX2)
// 256-bit integer code on both x86 tiers: with AVX512-VNNI (the avx512_bf16 and amx tiers) vpdpwssd does the
// multiply-adds, at 256 bits (AVX512-VL); 512-bit registers measured slower here (two ports rather than three).
using B16 = __m128i;
using W16 = __m256i;
using VI = __m256i;
using VF = __m256;
inline B16 ld16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline B16 lo4(B16 v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline B16 hi4(B16 v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }
template <int S>
inline B16 bits2(B16 v) { return _mm_and_si128(_mm_srli_epi16(v, S), _mm_set1_epi8(3)); }
inline B16 or_shl4(B16 a, B16 b) { return _mm_or_si128(a, _mm_slli_epi16(b, 4)); }  // b <= 3: no carry across bytes
inline B16 sub(B16 v, int8_t k) { return _mm_sub_epi8(v, _mm_set1_epi8(k)); }
inline W16 widen(B16 v) { return _mm256_cvtepi8_epi16(v); }
inline void nibbles(B16 raw, W16* lo, W16* hi) {  // widened first: the high nibble is then a shift alone
  const __m256i w = _mm256_cvtepu8_epi16(raw);
  *lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
  *hi = _mm256_srli_epi16(w, 4);
}
inline VI dot_acc(VI acc, W16 w, const QAct* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, xv);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
#endif
}
inline VI dot16(W16 w, const QAct* x) { return dot_acc(_mm256_setzero_si256(), w, x); }
inline VI dot32(W16 w0, W16 w1, const QAct* x) { return dot_acc(dot16(w0, x), w1, x + 16); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF fmadd(float s, VI v, VF acc) { return _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(v), acc); }
using S2 = __m128;
inline S2 mul_halves(const uint8_t* p, const float* f) {
  int32_t h;
  std::memcpy(&h, p, 4);
  const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
  return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)), pair);
}
inline VF fmadd_first(S2 s, VI v, VF acc) {
  return _mm256_fmadd_ps(_mm256_broadcastss_ps(s), _mm256_cvtepi32_ps(v), acc);
}
inline S2 zero2() { return _mm_setzero_ps(); }
inline S2 add2(S2 a, S2 b) { return _mm_add_ps(a, b); }
inline float second(S2 s) { return _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1)); }
inline float hsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIsa = "avx512-vnni";
#elif defined(SHOAL_GGUF_AVX512)
constexpr const char* kIsa = "avx512";
#else
constexpr const char* kIsa = "avx2";
#endif

#elif defined(SHOAL_GGUF_NEON)
constexpr const char* kIsa = "neon";
using B16 = uint8x16_t;
struct W16 { int16x8_t a, b; };
using VI = int32x4_t;
using VF = float32x4_t;
inline B16 ld16(const uint8_t* p) { return vld1q_u8(p); }
inline B16 lo4(B16 v) { return vandq_u8(v, vdupq_n_u8(0x0F)); }
inline B16 hi4(B16 v) { return vshrq_n_u8(v, 4); }
template <int S>
inline B16 bits2(B16 v) { return vandq_u8(vshrq_n_u8(v, S), vdupq_n_u8(3)); }
template <>
inline B16 bits2<0>(B16 v) { return vandq_u8(v, vdupq_n_u8(3)); }  // vshrq_n_u8 takes shifts of 1..8
inline B16 or_shl4(B16 a, B16 b) { return vorrq_u8(a, vshlq_n_u8(b, 4)); }
inline B16 sub(B16 v, int8_t k) { return vsubq_u8(v, vdupq_n_u8(static_cast<uint8_t>(k))); }
inline W16 widen(B16 v) {
  const int8x16_t s = vreinterpretq_s8_u8(v);
  return {vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s)};
}
inline void nibbles(B16 raw, W16* lo, W16* hi) {
  const uint16x8_t a = vmovl_u8(vget_low_u8(raw)), b = vmovl_high_u8(raw), m = vdupq_n_u16(0x0F);
  *lo = {vreinterpretq_s16_u16(vandq_u16(a, m)), vreinterpretq_s16_u16(vandq_u16(b, m))};
  *hi = {vreinterpretq_s16_u16(vshrq_n_u16(a, 4)), vreinterpretq_s16_u16(vshrq_n_u16(b, 4))};
}
inline VI dot_acc(VI acc, W16 w, const QAct* x) {
  const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
  acc = vmlal_s16(acc, vget_low_s16(w.a), vget_low_s16(x0));
  acc = vmlal_high_s16(acc, w.a, x0);
  acc = vmlal_s16(acc, vget_low_s16(w.b), vget_low_s16(x1));
  return vmlal_high_s16(acc, w.b, x1);
}
inline VI dot16(W16 w, const QAct* x) { return dot_acc(vdupq_n_s32(0), w, x); }
inline VI dot32(W16 w0, W16 w1, const QAct* x) { return dot_acc(dot16(w0, x), w1, x + 16); }
inline VF vzero() { return vdupq_n_f32(0.0f); }
inline VF fmadd(float s, VI v, VF acc) { return vfmaq_n_f32(acc, vcvtq_f32_s32(v), s); }
using S2 = float32x2_t;
inline S2 mul_halves(const uint8_t* p, const float* f) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  const float32x4_t both = vcvt_f32_f16(vreinterpret_f16_u32(vdup_n_u32(h)));
  return vmul_f32(vget_low_f32(both), vld1_f32(f));
}
inline VF fmadd_first(S2 s, VI v, VF acc) { return vfmaq_n_f32(acc, vcvtq_f32_s32(v), vget_lane_f32(s, 0)); }
inline S2 zero2() { return vdup_n_f32(0.0f); }
inline S2 add2(S2 a, S2 b) { return vadd_f32(a, b); }
inline float second(S2 s) { return vget_lane_f32(s, 1); }
inline float hsum(VF v) { return vaddvq_f32(v); }

#else  // portable: plain loops the compiler vectorises for its target (SSE2 on generic x86-64)
constexpr const char* kIsa = "portable";
struct B16 { uint8_t b[16]; };
struct W16 { int16_t w[16]; };
using VI = int32_t;
using VF = float;
inline B16 ld16(const uint8_t* p) { B16 r; std::memcpy(r.b, p, 16); return r; }
inline B16 lo4(B16 v) { for (auto& c : v.b) c &= 0x0F; return v; }
inline B16 hi4(B16 v) { for (auto& c : v.b) c >>= 4; return v; }
template <int S>
inline B16 bits2(B16 v) { for (auto& c : v.b) c = (c >> S) & 3; return v; }
inline B16 or_shl4(B16 a, B16 b) { for (int i = 0; i < 16; ++i) a.b[i] |= b.b[i] << 4; return a; }
inline B16 sub(B16 v, int8_t k) { for (auto& c : v.b) c = static_cast<uint8_t>(c - k); return v; }
inline W16 widen(B16 v) { W16 w; for (int i = 0; i < 16; ++i) w.w[i] = static_cast<int8_t>(v.b[i]); return w; }
inline void nibbles(B16 raw, W16* lo, W16* hi) {
  for (int i = 0; i < 16; ++i) {
    lo->w[i] = raw.b[i] & 0x0F;
    hi->w[i] = raw.b[i] >> 4;
  }
}
inline VI dot16(W16 w, const QAct* x) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += w.w[i] * x[i];
  return s;
}
inline VI dot32(W16 w0, W16 w1, const QAct* x) { return dot16(w0, x) + dot16(w1, x + 16); }
inline VF vzero() { return 0.0f; }
inline VF fmadd(float s, VI v, VF acc) { return acc + s * static_cast<float>(v); }
struct S2 { float first, second; };
inline S2 mul_halves(const uint8_t* p, const float* f) { return {half_at(p) * f[0], half_at(p + 2) * f[1]}; }
inline VF fmadd_first(S2 s, VI v, VF acc) { return fmadd(s.first, v, acc); }
inline S2 zero2() { return {0.0f, 0.0f}; }
inline S2 add2(S2 a, S2 b) { return {a.first + b.first, a.second + b.second}; }
inline float second(S2 s) { return s.second; }
inline float hsum(VF v) { return v; }
#endif

// ------------------------------------------------------------------------------------------- row dot products

// out[i * MR + r] = dot(weight row i, activation row r) for NR weight rows (rows[i]) and the MR quantized
// activation rows of `a` (K each). Each weight group is unpacked once for the MR rows; the NR x MR accumulators
// are independent chains, so their latencies overlap.
template <int QT, int NR, int MR>
void dot_tile(const uint8_t* const* rows, int64_t K, const QRows& a, float* out) {
  VF acc[NR][MR];
  float offset[NR][MR];
  S2 offset2[NR][MR];  // Q4_1: m * sum in the second lane
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) {
      acc[i][r] = vzero();
      offset[i][r] = 0.0f;
      offset2[i][r] = zero2();
    }
  const int64_t ldq = a.ld * 32;
  if constexpr (QT == Q8_0 || QT == Q4_0 || QT == Q4_1) {
    constexpr int bytes = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
    for (int64_t g = 0; g < K / 32; ++g) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = rows[i] + g * bytes;
        W16 lo, hi;
        if constexpr (QT == Q8_0) {
          lo = widen(ld16(blk + 2));
          hi = widen(ld16(blk + 18));
        } else if constexpr (QT == Q4_0) {
          nibbles(ld16(blk + 2), &lo, &hi);
        } else {
          nibbles(ld16(blk + 4), &lo, &hi);
        }
        for (int r = 0; r < MR; ++r) {
          const VI v = dot32(lo, hi, a.q + r * ldq + g * 32);
          const float* ds = a.ds + 2 * (r * a.ld + g);
          if constexpr (QT == Q4_1) {
            const S2 s = mul_halves(blk, ds);  // (d dx, m sum)
            acc[i][r] = fmadd_first(s, v, acc[i][r]);
            offset2[i][r] = add2(offset2[i][r], s);
          } else if constexpr (QT == Q4_0) {  // w = d q - 8 d: the 8 d multiplies the group's exact sum
            const float d = half_at(blk);
            acc[i][r] = fmadd(d * ds[0], v, acc[i][r]);
            offset[i][r] -= 8.0f * d * ds[1];
          } else {
            acc[i][r] = fmadd(half_at(blk) * ds[0], v, acc[i][r]);
          }
        }
      }
    }
  } else if constexpr (QT == Q4_K) {
    for (int64_t b = 0; b < K / 256; ++b) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = rows[i] + b * 144;
        const float d = half_at(blk), dmin = half_at(blk + 2);
        const uint8_t* q = blk + 16;
        for (int j = 0; j < 8; j += 2, q += 32) {
          int sc0, mn0, sc1, mn1;
          q4k_scale_min(j, blk + 4, &sc0, &mn0);
          q4k_scale_min(j + 1, blk + 4, &sc1, &mn1);
          W16 lo0, lo1, hi0, hi1;  // groups j (low nibbles) and j + 1 (high), weights 0-15 and 16-31
          nibbles(ld16(q), &lo0, &lo1);
          nibbles(ld16(q + 16), &hi0, &hi1);
          const int64_t g = b * 8 + j;
          for (int r = 0; r < MR; ++r) {
            const QAct* xq = a.q + r * ldq + g * 32;
            const float* ds = a.ds + 2 * (r * a.ld + g);  // groups g and g + 1
            acc[i][r] = fmadd(d * sc0 * ds[0], dot32(lo0, hi0, xq), acc[i][r]);
            acc[i][r] = fmadd(d * sc1 * ds[2], dot32(lo1, hi1, xq + 32), acc[i][r]);
            offset[i][r] -= dmin * (mn0 * ds[1] + mn1 * ds[3]);
          }
        }
      }
    }
  } else {
    static_assert(QT == Q6_K, "dot_tile: not a packed GGUF type");
    for (int64_t b = 0; b < K / 256; ++b) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = rows[i] + b * 210;
        const float d = half_at(blk + 208);
        for (int half = 0; half < 2; ++half) {
          const uint8_t* ql = blk + half * 64;
          const uint8_t* qh = blk + 128 + half * 32;
          const int8_t* s = reinterpret_cast<const int8_t*>(blk + 192) + half * 8;
          const B16 l0 = ld16(ql), l1 = ld16(ql + 16), l2 = ld16(ql + 32), l3 = ld16(ql + 48);
          const B16 h0 = ld16(qh), h1 = ld16(qh + 16);
          // weights l, l + 32, l + 64, l + 96 of this half (l = 0..31) as q - 32, 16 at a time (a scale each)
          const B16 q[8] = {
              or_shl4(lo4(l0), bits2<0>(h0)), or_shl4(lo4(l1), bits2<0>(h1)),
              or_shl4(lo4(l2), bits2<2>(h0)), or_shl4(lo4(l3), bits2<2>(h1)),
              or_shl4(hi4(l0), bits2<4>(h0)), or_shl4(hi4(l1), bits2<4>(h1)),
              or_shl4(hi4(l2), bits2<6>(h0)), or_shl4(hi4(l3), bits2<6>(h1)),
          };
          const int64_t g0 = b * 8 + half * 4;
          for (int k = 0; k < 8; ++k) {
            const W16 w = widen(sub(q[k], 32));
            for (int r = 0; r < MR; ++r) {
              const float* ds = a.ds + 2 * (r * a.ld + g0 + k / 2);
              acc[i][r] = fmadd(d * s[k] * ds[0], dot16(w, a.q + r * ldq + (g0 + k / 2) * 32 + (k % 2) * 16),
                                acc[i][r]);
            }
          }
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) out[i * MR + r] = hsum(acc[i][r]) + offset[i][r] + second(offset2[i][r]);
}

constexpr int64_t kPrefetchRows = 8;  // M == 1: how far ahead (in weight rows) to prefetch

// out[r * ldo + n - n0] = dot(weight row n, activation row r) for rows [n0, n1) of a [rows, row_bytes] weight and
// the M quantized activation rows of `a`. One activation row: four weight rows at a time (independent chains over
// one read of the activations); more: up to four activation rows share each weight row's unpacking.
template <int QT>
void dot_rows_t(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QRows& a, int64_t M, int64_t K,
                float* out, int64_t ldo) {
  float o[4];
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) {
      // The next tiles' bytes, requested ahead: without it the cores wait on memory and compute in turn.
      const uint8_t* ahead = w + (n + kPrefetchRows) * row_bytes;
      const uint8_t* end = w + n1 * row_bytes;
      for (int64_t off = 0; off < 4 * row_bytes && ahead + off < end; off += 64) __builtin_prefetch(ahead + off);
      const uint8_t* rows[4] = {w + n * row_bytes, w + (n + 1) * row_bytes, w + (n + 2) * row_bytes,
                                w + (n + 3) * row_bytes};
      dot_tile<QT, 4, 1>(rows, K, a, out + n - n0);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; m += 4) {
      const QRows am{a.q + m * a.ld * 32, a.ds + m * a.ld * 2, a.ld};
      switch (M - m < 4 ? M - m : 4) {
        case 4: dot_tile<QT, 1, 4>(&row, K, am, o); break;
        case 3: dot_tile<QT, 1, 3>(&row, K, am, o); break;
        case 2: dot_tile<QT, 1, 2>(&row, K, am, o); break;
        default: dot_tile<QT, 1, 1>(&row, K, am, o); break;
      }
      for (int64_t r = 0; r < 4 && m + r < M; ++r) out[(m + r) * ldo + n - n0] = o[r];
    }
  }
}

inline void dot_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QRows& a,
                     int64_t M, int64_t K, float* out, int64_t ldo) {
  switch (qtype) {
    case Q8_0: return dot_rows_t<Q8_0>(w, row_bytes, n0, n1, a, M, K, out, ldo);
    case Q4_0: return dot_rows_t<Q4_0>(w, row_bytes, n0, n1, a, M, K, out, ldo);
    case Q4_1: return dot_rows_t<Q4_1>(w, row_bytes, n0, n1, a, M, K, out, ldo);
    case Q4_K: return dot_rows_t<Q4_K>(w, row_bytes, n0, n1, a, M, K, out, ldo);
    case Q6_K: return dot_rows_t<Q6_K>(w, row_bytes, n0, n1, a, M, K, out, ldo);
  }
}

}  // namespace shoal_gguf
