// CPU paged attention over the flat batch described in engine/attention/base.py.
//
// Keys and values are read in place from the paged cache [num_blocks, block_size, kv_heads, head_dim] through
// the block table: nothing is gathered into a dense copy. One work item is (sequence, kv head, query tile): it
// holds the tile's rows for all GROUP query heads sharing that kv head (row = token-major, head-minor), so every
// K/V block is read once per tile, and streams the sequence's keys block by block with an online
// (FlashAttention-style) softmax in float32. Items are scheduled dynamically over OpenMP threads (torch's own
// libgomp, so torch.set_num_threads applies), biggest first. Attention sinks (gpt-oss: one learned logit per head
// that joins every softmax denominator and weighs no value) start each row's online softmax (init_row_softmax).
//
// Only light headers are included (not torch/extension.h): the build takes seconds instead of ~40 s. The op is
// registered with the dispatcher (TORCH_LIBRARY) and called as torch.ops.shoal_cpu_paged.paged_attention.
//
// The generic path leaves vectorisation to the compiler (-O3 -fopenmp and the ISA flags of the CPU tier, see execution/native_build.py): `#pragma omp simd` lets it
// vectorise the float reductions over head_dim without -ffast-math, and exp2 is a polynomial (no libm call) so it
// vectorises. Where the CPU has AVX512-BF16, bfloat16 caches with head_dim % 32 == 0 take a path written with
// intrinsics (attend_tile_avx512bf16) that multiplies bf16 directly instead of converting to float: ~1.4x faster.
//
// FP8 caches (--kv-cache-dtype fp8): keys/values are float8_e4m3fn bytes with one float32 scale per (slot, kv head)
// (see engine/attention/base.py). The cache element type is a template parameter of its own (queries and output
// stay in the model dtype); a block's rows are decoded to float with a branch-free bit conversion and multiplied
// by their row's scale in the same pass, so the rest of the tile code is the float path unchanged.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_math.h"
#include "scalar_types.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxHeadDim = 256;
constexpr int kTileRows = 64;  // target rows (tokens x heads of a group) per query tile
bool use_fast_path = true;     // the AVX512-BF16 path, when compiled in (tests switch it off to cover the other)

// ---------------------------------------------------------------------------------------------- conversions

using shoal::from_float;
using shoal::to_float;

// A float8_e4m3fn cache element (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities).
struct Fp8E4M3 {
  uint8_t x;
};
// Branch-free (the select is integer masking, not a conditional), so that `omp simd` loops over a row vectorise
// instead of gathering from a table. Normal numbers: the 7 magnitude bits shifted into a float's exponent/mantissa
// fields are the same number with exponent bias 7 instead of 127, so adding 120 to the exponent field rebiases it.
// Subnormals (exponent 0) are mantissa * 2^-9, computed from the integer: no float denormal is ever formed (those
// can cost a microcode assist per operation on x86). 0x7F/0xFF (NaN) decode to +-480: quantize_fp8 clamps, so the
// cache never holds them.
inline float to_float(Fp8E4M3 v) {
  const uint32_t mag = v.x & 0x7Fu;
  const uint32_t normal = (mag << 20) + (120u << 23);
  const float subnormal_f = float(int32_t(mag)) * (1.0f / 512.0f);
  uint32_t subnormal;
  std::memcpy(&subnormal, &subnormal_f, sizeof subnormal);
  const uint32_t is_normal = 0u - uint32_t(mag >= 8u);
  const uint32_t bits = (normal & is_normal) | (subnormal & ~is_normal) | (uint32_t(v.x & 0x80u) << 24);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// float -> e4m3 code, round to nearest even, saturating at +-448: bit for bit what torch's .to(float8_e4m3fn)
// gives for values clamped to [-448, 448] (quantize_fp8 in engine/attention/base.py), branch-free so it vectorises.
// Normal range: round the float's mantissa to 3 bits (add 0x7FFFF plus the lowest kept bit, truncate), then
// rebias the exponent from 127 to 7. Below 2^-6 (e4m3's subnormals): the code is the integer nearest to y * 2^9,
// rounded half to even by the 1.5 * 2^23 trick; 8 there is exactly the smallest normal's code.
inline uint8_t fp8_from_float(float y) {
  y = std::min(std::max(y, -448.0f), 448.0f);
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &abs_bits, sizeof a);
  const uint32_t subnormal = uint32_t(int32_t((a * 512.0f + 12582912.0f) - 12582912.0f));
  const uint32_t normal = ((abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t is_subnormal = 0u - uint32_t(a < 0.015625f);
  return uint8_t((subnormal & is_subnormal) | (normal & ~is_subnormal) | sign);
}

// Scores live in the log2 domain (scale * log2(e) is folded into the queries), so softmax needs exp2 only.
using shoal::exp2_neg;  // fast_math.h

// ------------------------------------------------------------------------------------------------ the kernel

// T: queries and output (the model dtype); C: the cache's elements (T itself, or Fp8E4M3 with scales).
template <typename T, typename C = T>
struct Params {
  const T* q;
  T* out;
  const C* k;
  const C* v;
  const float* k_scale;  // fp8 caches: [num_blocks, block_size, kv_heads] row scales; else null
  const float* v_scale;
  int64_t sks_b, sks_s, sks_h, svs_b, svs_s, svs_h;  // scale strides
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* slopes;  // [H] or null
  const float* sinks;   // [H] attention-sink logits (gpt-oss) times log2(e), or null
  float qk_scale;       // softmax scale * log2(e)
  int window;           // sliding window: a query at position p sees keys p - window + 1 .. p (0: all keys)
  float softcap;        // attention-logit soft-cap * log2(e) (0: none): s -> softcap * tanh(s / softcap)
  int64_t sq_t, sq_h, so_t, so_h;  // q/out strides (head_dim is contiguous)
  int64_t sk_b, sk_s, sk_h, sv_b, sv_s, sv_h;  // cache strides
  int64_t bt_stride;
  int H, group, D, block_size, tile_tokens;
};

struct Item {
  int32_t seq, kv_head, t0, t1;  // query tokens [t0, t1) of the sequence's query
  int64_t cost;
};

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> q, acc, s, kbuf, vbuf, m, l;
  std::vector<const float*> krow, vrow;
  std::vector<uint16_t> qb;              // bf16 fast path: raw query rows
  std::vector<uint32_t> vpairs;          // bf16 fast path: interleaved value pairs
  std::vector<uint16_t> kb16;            // bf16 fast path over an fp8 cache: the block's keys decoded to bf16
  std::vector<float> kscale, vscale;     // ... and their row scales
  Scratch(int rows, int D, int bs, bool fp8)
      : q(size_t(rows) * D), acc(size_t(rows) * D), s(size_t(rows) * bs + 1), kbuf(size_t(bs) * D),
        vbuf(size_t(bs) * D), m(rows), l(rows), krow(bs), vrow(bs), qb(size_t(rows) * D),
        vpairs(size_t(bs / 2 + 1) * D), kb16(fp8 ? size_t(bs) * D : 0), kscale(fp8 ? bs : 0),
        vscale(fp8 ? bs : 0) {}
};

// Rows of one cache block as float pointers: straight into the cache for float32, else converted into `buf`
// (fp8 rows times their scale: scales[j * scale_stride]).
template <typename T>
inline void block_rows(const T* base, int64_t stride, int n, int D, float* buf, const float** rows,
                       const float* scales = nullptr, int64_t scale_stride = 0) {
  if constexpr (std::is_same_v<T, float>) {
    for (int j = 0; j < n; ++j) rows[j] = base + j * stride;
  } else if constexpr (std::is_same_v<T, Fp8E4M3>) {
    for (int j = 0; j < n; ++j) {
      const T* src = base + j * stride;
      float* dst = buf + size_t(j) * D;
      const float s = scales[j * scale_stride];
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]) * s;
      rows[j] = dst;
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const T* src = base + j * stride;
      float* dst = buf + size_t(j) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]);
      rows[j] = dst;
    }
  }
}

template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int n, int D) {
  const int64_t bytes = int64_t(D) * sizeof(T);
  for (int j = 0; j < n; ++j)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(base + j * stride) + off);
}

// The block table makes the address of a later block unpredictable to the hardware prefetcher: prefetch the
// keys/values of the block SHOAL_PREFETCH_AHEAD blocks ahead (0 to 3 measured within noise of each other on a Xeon;
// kept at 1 as cheap insurance against slower memory).
#ifndef SHOAL_PREFETCH_AHEAD
#define SHOAL_PREFETCH_AHEAD 1
#endif
template <typename T, typename C>
inline void prefetch_block(const Params<T, C>& p, const Item& it, const int32_t* table, int blk, int k0,
                           int kv_end) {
  constexpr int ahead = SHOAL_PREFETCH_AHEAD;
  const int start = k0 + ahead * p.block_size;
  if (ahead <= 0 || start >= kv_end) return;
  const int n = std::min(p.block_size, kv_end - start);
  const int64_t b = table[blk + ahead];
  prefetch_rows(p.k + b * p.sk_b + int64_t(it.kv_head) * p.sk_h, p.sk_s, n, p.D);
  prefetch_rows(p.v + b * p.sv_b + int64_t(it.kv_head) * p.sv_h, p.sv_s, n, p.D);
}

// The online softmax's starting state for a row of query head h: nothing seen (max -inf, sum 0), or, with attention
// sinks, the sink as if it were one more key whose value is zero: max = sink, sum = 2^(sink - max) = 1. Later keys
// rescale it like any other, so the sink only ever adds exp(sink) to the softmax denominator.
template <typename T, typename C>
inline void init_row_softmax(const Params<T, C>& p, int h, float& m, float& l) {
  if (p.sinks != nullptr) {
    m = p.sinks[h];
    l = 1.0f;
  } else {
    m = kNegInf;
    l = 0.0f;
  }
}

template <typename T, typename C>
void attend_tile(const Params<T, C>& p, const Item& it, Scratch& sc) {
  const int D = p.D, G = p.group, bs = p.block_size;
  const int q_start = p.query_start_loc[it.seq];
  const int q_len = p.query_start_loc[it.seq + 1] - q_start;
  const int ctx = p.seq_lens[it.seq] - q_len;  // cached tokens before this step's queries
  const int rows = (it.t1 - it.t0) * G;
  const int h0 = it.kv_head * G;
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();

  // Row r = (token t0 + r / G, query head h0 + r % G), at absolute position ctx + t0 + r / G.
  for (int r = 0; r < rows; ++r) {
    const T* src = p.q + int64_t(q_start + it.t0 + r / G) * p.sq_t + int64_t(h0 + r % G) * p.sq_h;
    float* dst = qf + size_t(r) * D;
    const float scale = p.qk_scale;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
    std::fill_n(acc + size_t(r) * D, D, 0.0f);
    init_row_softmax(p, h0 + r % G, m[r], l[r]);
  }

  const int32_t* table = p.block_tables + int64_t(it.seq) * p.bt_stride;
  const int kv_end = ctx + it.t1;  // keys visible to the tile's last token (causal)
  // With a sliding window, blocks before the tile's first token's window are never read (they may be freed).
  const int first_blk = p.window > 0 ? std::max(0, ctx + it.t0 - p.window + 1) / bs : 0;
  for (int k0 = first_blk * bs, blk = first_blk; k0 < kv_end; k0 += bs, ++blk) {
    const int n = std::min(bs, kv_end - k0);
    const int64_t b = table[blk];
    prefetch_block(p, it, table, blk, k0, kv_end);
    const int64_t kh = int64_t(it.kv_head);
    if constexpr (std::is_same_v<C, Fp8E4M3>) {
      block_rows(p.k + b * p.sk_b + kh * p.sk_h, p.sk_s, n, D, sc.kbuf.data(), sc.krow.data(),
                 p.k_scale + b * p.sks_b + kh * p.sks_h, p.sks_s);
      block_rows(p.v + b * p.sv_b + kh * p.sv_h, p.sv_s, n, D, sc.vbuf.data(), sc.vrow.data(),
                 p.v_scale + b * p.svs_b + kh * p.svs_h, p.svs_s);
    } else {
      block_rows(p.k + b * p.sk_b + kh * p.sk_h, p.sk_s, n, D, sc.kbuf.data(), sc.krow.data());
      block_rows(p.v + b * p.sv_b + kh * p.sv_h, p.sv_s, n, D, sc.vbuf.data(), sc.vrow.data());
    }
    const float* const* K = sc.krow.data();
    const float* const* V = sc.vrow.data();

    for (int r = 0; r < rows; ++r) {
      const int pos = ctx + it.t0 + r / G;
      // Causal mask without -inf: the row only looks at the block's first nr keys (none when it starts later).
      const int nr = std::min(n, pos - k0 + 1);
      // Sliding window: the row skips the block's keys before position pos - window + 1.
      const int j0 = p.window > 0 ? std::max(0, pos - p.window + 1 - k0) : 0;
      if (nr <= j0) continue;
      const float* qr = qf + size_t(r) * D;
      float* s = sc.s.data() + size_t(r) * bs;

      // Scores, four keys at a time: four independent accumulator chains that share each load of q.
      int j = j0;
      for (; j + 4 <= nr; j += 4) {
        const float *k_0 = K[j], *k_1 = K[j + 1], *k_2 = K[j + 2], *k_3 = K[j + 3];
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int d = 0; d < D; ++d) {
          const float x = qr[d];
          a0 += x * k_0[d];
          a1 += x * k_1[d];
          a2 += x * k_2[d];
          a3 += x * k_3[d];
        }
        s[j] = a0, s[j + 1] = a1, s[j + 2] = a2, s[j + 3] = a3;
      }
      for (; j < nr; ++j) {
        const float* kj = K[j];
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int d = 0; d < D; ++d) a += qr[d] * kj[d];
        s[j] = a;
      }
      if (p.softcap > 0.f) {
        for (int jj = j0; jj < nr; ++jj) s[jj] = p.softcap * std::tanh(s[jj] / p.softcap);
      }
      if (p.slopes != nullptr) {  // ALiBi: slope * (key_pos - query_pos), in the log2 domain like the scores
        const float slope = p.slopes[h0 + r % G] * kLog2e;
        for (int jj = j0; jj < nr; ++jj) s[jj] += slope * float(k0 + jj - pos);
      }

      // Online softmax: rescale what was accumulated so far by 2^(old max - new max).
      float mx = m[r];
      for (int jj = j0; jj < nr; ++jj) mx = std::max(mx, s[jj]);
      const float corr = exp2_neg(m[r] - mx);  // 0 on the first block (m = -inf)
      m[r] = mx;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int jj = j0; jj < nr; ++jj) {
        s[jj] = exp2_neg(s[jj] - mx);
        sum += s[jj];
      }
      l[r] = l[r] * corr + sum;

      // acc = acc * corr + P V, four keys per pass over the accumulator row (which stays in L1). The key loop
      // must stay outside the d loop: with it inside, GCC vectorises over keys with gathers.
      float* a = acc + size_t(r) * D;
      if (corr != 1.0f) {
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] *= corr;
      }
      int jj = j0;
      for (; jj + 4 <= nr; jj += 4) {
        const float p0 = s[jj], p1 = s[jj + 1], p2 = s[jj + 2], p3 = s[jj + 3];
        const float *v0 = V[jj], *v1 = V[jj + 1], *v2 = V[jj + 2], *v3 = V[jj + 3];
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
      }
      for (; jj < nr; ++jj) {
        const float pj = s[jj];
        const float* vj = V[jj];
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += pj * vj[d];
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = p.out + int64_t(q_start + it.t0 + r / G) * p.so_t + int64_t(h0 + r % G) * p.so_h;
    const float* a = acc + size_t(r) * D;
    const float inv = 1.0f / l[r];  // l >= 1: every row sees at least its own key (or its sink)
    for (int d = 0; d < D; ++d) dst[d] = from_float<T>(a[d] * inv);
  }
}

// ------------------------------------------------- bfloat16 fast path: AVX512-BF16 dot products (vdpbf16ps)
//
// On CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later; the avx512_bf16 and amx tiers build it) a bfloat16 cache with
// head_dim a multiple of 32 skips the float conversions: vdpbf16ps multiplies pairs of bf16 values exactly and
// accumulates them in float32, 32 products per instruction.
//   Scores: q (kept as raw bf16, the scale applied afterwards) against each key row, straight from the cache,
//           16 keys at a time into one register (sixteen dot-product chains, one in-register reduction), so the
//           block's max, exponentials and sum never pass through memory: the per-row path that stored scores and
//           probabilities and read them back at another width stalled store forwarding (~9% of the kernel's time).
//   P V:    keys are taken in pairs (j, j+1); one permute per 32 dims interleaves the two value rows into
//           (v[j][d], v[j+1][d]) pairs, so the d-th float lane accumulates p[j] v[j][d] + p[j+1] v[j+1][d] with
//           (p[j], p[j+1]) broadcast. P is rounded to bf16 for this product (as FlashAttention does on GPUs);
//           the softmax sum l and everything else stay float32.
// An fp8 cache takes the same path with bfloat16 queries: each block's rows are decoded to bf16 once (exact: bf16
// has more exponent and mantissa bits than e4m3) into scratch, 32 values per few integer instructions; key scales
// multiply the scores and value scales the probabilities (after the softmax sum l is taken), as in the Triton kernel.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SHOAL_AVX512_BF16 1

// 32 e4m3 codes to 32 bfloat16 values. bf16 shares float32's exponent, so the float trick of to_float(Fp8E4M3)
// works on 16-bit lanes: magnitude bits << 4, exponent rebiased by + 120 << 7. Subnormals (magnitude < 8) come from
// an 8-entry table (a permute), blended in by a compare mask.
inline __m512i fp8x32_to_bf16(const uint8_t* src, __m512i subnormals) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i r = _mm512_mask_blend_epi16(is_sub, normal, _mm512_permutexvar_epi16(mag, subnormals));
  return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

inline __m512i fp8_subnormal_table() {
  alignas(64) uint16_t t[32] = {};
  for (int m = 0; m < 8; ++m) t[m] = c10::BFloat16(float(m) / 512.0f).x;  // m * 2^-9, exact in bf16
  return _mm512_load_si512(t);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// The sums of sixteen vectors as one vector (lane j: the sum of a[j]), all in registers: pairs are folded within
// 128-bit lanes (unpack, then shuffle), then the four lanes of four vectors are transposed and added. 45
// instructions, and the scores never pass through memory (a store then a wider load stalls store forwarding).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane L of c[i]: the lane-L sums of a[4i .. 4i + 3]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

inline __m512i kIota16() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// exp2_neg (fast_math.h) on sixteen lanes: the same rounding, polynomial and exponent-bit construction.
inline __m512 exp2_neg16(__m512 x) {
  const __m512 y = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 q = _mm512_set1_ps(1.0f / 5040.0f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f / 720.0f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f / 120.0f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f / 24.0f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f / 6.0f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(q, _mm512_castsi512_ps(bits));
}

alignas(64) const uint16_t kZeroRow[kMaxHeadDim] = {};

// The raw scores q . k_j of sixteen consecutive key rows (stride apart; rows from nr on read as zeros, so nothing
// past the block is touched): sixteen independent vdpbf16ps chains over head_dim, then one reduce16.
inline __m512 chunk_scores(const c10::BFloat16* K, int64_t stride, int nr, const uint16_t* q, int D) {
  const uint16_t* rows[16];
  for (int j = 0; j < 16; ++j)
    rows[j] = j < nr ? reinterpret_cast<const uint16_t*>(K + int64_t(j) * stride) : kZeroRow;
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 32) {
    const __m512bh qv = as_bh(_mm512_loadu_si512(q + c));
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) a[j] = _mm512_dpbf16_ps(a[j], as_bh(_mm512_loadu_si512(rows[j] + c)), qv);
  }
  return reduce16(a);
}

template <typename C>
void attend_tile_avx512bf16(const Params<c10::BFloat16, C>& p, const Item& it, Scratch& sc) {
  constexpr bool kFp8 = std::is_same_v<C, Fp8E4M3>;
  const int D = p.D, G = p.group, bs = p.block_size;
  const int q_start = p.query_start_loc[it.seq];
  const int q_len = p.query_start_loc[it.seq + 1] - q_start;
  const int ctx = p.seq_lens[it.seq] - q_len;
  const int rows = (it.t1 - it.t0) * G;
  const int h0 = it.kv_head * G;
  uint16_t* qb = sc.qb.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  uint32_t* vp = sc.vpairs.data();  // [ceil(bs / 2)][D] interleaved value pairs

  for (int r = 0; r < rows; ++r) {
    const c10::BFloat16* src = p.q + int64_t(q_start + it.t0 + r / G) * p.sq_t + int64_t(h0 + r % G) * p.sq_h;
    std::memcpy(qb + size_t(r) * D, src, sizeof(uint16_t) * D);
    std::fill_n(acc + size_t(r) * D, D, 0.0f);
    init_row_softmax(p, h0 + r % G, m[r], l[r]);
  }
  // Word k of the interleave takes a[k / 2] for even k, b[k / 2] for odd k (indices >= 32 select b); the second
  // permute does the same for elements 16..31.
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int k = 0; k < 32; ++k) {
    lo_idx[k] = uint16_t((k & 1) * 32 + k / 2);
    hi_idx[k] = uint16_t((k & 1) * 32 + 16 + k / 2);
  }
  const __m512i idx_lo = _mm512_load_si512(lo_idx), idx_hi = _mm512_load_si512(hi_idx);
  __m512i subnormals = _mm512_setzero_si512();
  if constexpr (kFp8) subnormals = fp8_subnormal_table();

  const int32_t* table = p.block_tables + int64_t(it.seq) * p.bt_stride;
  const int kv_end = ctx + it.t1;
  for (int k0 = 0, blk = 0; k0 < kv_end; k0 += bs, ++blk) {
    const int n = std::min(bs, kv_end - k0);
    const int64_t b = table[blk];
    prefetch_block(p, it, table, blk, k0, kv_end);
    const C* Vc = p.v + b * p.sv_b + int64_t(it.kv_head) * p.sv_h;
    const c10::BFloat16* K;
    int64_t k_stride;  // between a block's key rows
    if constexpr (kFp8) {  // keys decoded once into scratch (every row of the tile reads them); values below
      const int64_t kh = int64_t(it.kv_head);
      const C* kc = p.k + b * p.sk_b + kh * p.sk_h;
      for (int j = 0; j < n; ++j) {
        for (int c = 0; c < D; c += 32)
          _mm512_storeu_si512(sc.kb16.data() + size_t(j) * D + c,
                              fp8x32_to_bf16(&kc[int64_t(j) * p.sk_s + c].x, subnormals));
        sc.kscale[j] = p.k_scale[b * p.sks_b + kh * p.sks_h + j * p.sks_s];
        sc.vscale[j] = p.v_scale[b * p.svs_b + kh * p.svs_h + j * p.svs_s];
      }
      K = reinterpret_cast<const c10::BFloat16*>(sc.kb16.data());
      k_stride = D;
    } else {
      K = p.k + b * p.sk_b + int64_t(it.kv_head) * p.sk_h;
      k_stride = p.sk_s;
    }

    // Interleave value rows pairwise once per block, for all rows of the tile (an odd last key pairs with 0s);
    // fp8 values are decoded on the way, straight from the cache.
    const int npairs = (n + 1) / 2;
    for (int jp = 0; jp < npairs; ++jp) {
      const C* v0 = Vc + int64_t(2 * jp) * p.sv_s;
      const C* v1 = Vc + int64_t(2 * jp + 1) * p.sv_s;
      for (int c = 0; c < D; c += 32) {
        __m512i a, bb;
        if constexpr (kFp8) {
          a = fp8x32_to_bf16(&v0[c].x, subnormals);
          bb = 2 * jp + 1 < n ? fp8x32_to_bf16(&v1[c].x, subnormals) : _mm512_setzero_si512();
        } else {
          a = _mm512_loadu_si512(v0 + c);
          bb = 2 * jp + 1 < n ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
        }
        _mm512_storeu_si512(vp + size_t(jp) * D + c, _mm512_permutex2var_epi16(a, idx_lo, bb));
        _mm512_storeu_si512(vp + size_t(jp) * D + c + 16, _mm512_permutex2var_epi16(a, idx_hi, bb));
      }
    }

    for (int r = 0; r < rows; ++r) {
      const int pos = ctx + it.t0 + r / G;
      const uint16_t* qr = qb + size_t(r) * D;
      float* a = acc + size_t(r) * D;
      const float slope = p.slopes != nullptr ? p.slopes[h0 + r % G] * kLog2e : 0.0f;
      for (int c0 = 0; c0 < n; c0 += 16) {  // 16 keys at a time, their scores in one register
        const int nr = std::min(std::min(16, n - c0), pos - (k0 + c0) + 1);
        if (nr <= 0) break;
        const __mmask16 live = _cvtu32_mask16((1u << nr) - 1u);
        __m512 sv = _mm512_mul_ps(chunk_scores(K + int64_t(c0) * k_stride, k_stride, nr, qr, D),
                                  _mm512_set1_ps(p.qk_scale));
        if constexpr (kFp8) sv = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(live, sc.kscale.data() + c0));
        if (p.slopes != nullptr) {
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(k0 + c0 - pos), kIota16());
          sv = _mm512_add_ps(sv, _mm512_mul_ps(_mm512_set1_ps(slope), _mm512_cvtepi32_ps(key)));
        }
        sv = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live, sv);
        const float mx = std::max(m[r], _mm512_reduce_max_ps(sv));
        const float corr = exp2_neg(m[r] - mx);
        m[r] = mx;
        __m512 pv = exp2_neg16(_mm512_sub_ps(sv, _mm512_set1_ps(mx)));  // keys past nr: exactly 0
        l[r] = l[r] * corr + _mm512_reduce_add_ps(pv);
        if constexpr (kFp8) pv = _mm512_mul_ps(pv, _mm512_maskz_loadu_ps(live, sc.vscale.data() + c0));
        // Probabilities to bf16: consecutive bf16 values are exactly the (p[j], p[j+1]) pairs. A full-width store
        // (not a masked one) so that the pair loads below are forwarded from it instead of waiting for it.
        alignas(32) uint32_t pp[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(pv));
        const int rp = (nr + 1) / 2;
        const uint32_t* vpc = vp + size_t(c0 / 2) * D;
        // acc = acc * corr + P V, 64 dims at a time in four registers: four independent vdpbf16ps chains over the
        // chunk's key pairs (one chain per 16 dims would wait on its own latency at every pair).
        const __m512 cv = _mm512_set1_ps(corr);
        int c = 0;
        for (; c + 64 <= D; c += 64) {
          __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(a + c), cv), x1 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 16), cv);
          __m512 x2 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 32), cv), x3 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 48), cv);
          for (int jp = 0; jp < rp; ++jp) {
            const __m512bh pb = as_bh(_mm512_set1_epi32(int(pp[jp])));
            const uint32_t* row = vpc + size_t(jp) * D + c;
            x0 = _mm512_dpbf16_ps(x0, as_bh(_mm512_loadu_si512(row)), pb);
            x1 = _mm512_dpbf16_ps(x1, as_bh(_mm512_loadu_si512(row + 16)), pb);
            x2 = _mm512_dpbf16_ps(x2, as_bh(_mm512_loadu_si512(row + 32)), pb);
            x3 = _mm512_dpbf16_ps(x3, as_bh(_mm512_loadu_si512(row + 48)), pb);
          }
          _mm512_storeu_ps(a + c, x0), _mm512_storeu_ps(a + c + 16, x1);
          _mm512_storeu_ps(a + c + 32, x2), _mm512_storeu_ps(a + c + 48, x3);
        }
        if (c < D) {  // D % 64 == 32: the last 32 dims in two chains
          __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(a + c), cv), x1 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 16), cv);
          for (int jp = 0; jp < rp; ++jp) {
            const __m512bh pb = as_bh(_mm512_set1_epi32(int(pp[jp])));
            const uint32_t* row = vpc + size_t(jp) * D + c;
            x0 = _mm512_dpbf16_ps(x0, as_bh(_mm512_loadu_si512(row)), pb);
            x1 = _mm512_dpbf16_ps(x1, as_bh(_mm512_loadu_si512(row + 16)), pb);
          }
          _mm512_storeu_ps(a + c, x0), _mm512_storeu_ps(a + c + 16, x1);
        }
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    c10::BFloat16* dst = p.out + int64_t(q_start + it.t0 + r / G) * p.so_t + int64_t(h0 + r % G) * p.so_h;
    const float* a = acc + size_t(r) * D;
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = c10::BFloat16(a[d] * inv);
  }
}
#endif

template <typename T, typename C>
void run(const Params<T, C>& p, int num_seqs, int kv_heads, const bool* skip) {
  // Work items, most expensive first so that dynamic scheduling ends balanced.
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    if (skip != nullptr && skip[s]) continue;  // the caller computes this one (a long prefill chunk)
    const int ctx = p.seq_lens[s] - q_len;
    for (int t0 = 0; t0 < q_len; t0 += p.tile_tokens) {
      const int t1 = std::min(q_len, t0 + p.tile_tokens);
      const int64_t cost = int64_t(t1 - t0) * (ctx + t1) + 64;  // + fixed overhead per item
      for (int g = 0; g < kv_heads; ++g) items.push_back({s, g, t0, t1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const int64_t n_items = int64_t(items.size());
#pragma omp parallel if (n_items > 1)
  {
    Scratch scratch(p.tile_tokens * p.group, p.D, p.block_size, std::is_same_v<C, Fp8E4M3>);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
#ifdef SHOAL_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> &&
                    (std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, Fp8E4M3>)) {
        if (p.D % 32 == 0 && use_fast_path && p.window == 0 && p.softcap == 0.f) {
          attend_tile_avx512bf16(p, items[i], scratch);
          continue;
        }
      }
#endif
      attend_tile(p, items[i], scratch);
    }
  }
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const std::optional<at::Tensor>& alibi_slopes,
                     double scale, const std::optional<at::Tensor>& skip_seqs,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "sliding window and soft-cap must be >= 0 (0: off)");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "expected q/out [T, H, D] and caches [num_blocks, block_size, kv_heads, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == D, "k/v cache shapes must match q");
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK(kvh >= 1 && H % kvh == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", kvh, ")");
  const auto dtype = q.scalar_type();
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(out.scalar_type() == dtype && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (fp8 || k_cache.scalar_type() == dtype),
              "q and out must share a dtype, and the caches must have it too (or both be float8_e4m3fn)");
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              fp8 ? "a float8_e4m3fn cache needs k_scale and v_scale" : "k_scale/v_scale are for fp8 caches only");
  if (fp8) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == k_cache.size(0) &&
                      t->size(1) == bs && t->size(2) == kvh,
                  "k_scale/v_scale must be float32 [num_blocks, block_size, kv_heads]");
  }
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata tensors must be contiguous int32");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.dim() == 2 && block_tables.size(0) >= B,
              "inconsistent metadata shapes");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must span q's ", T, " tokens");
  for (int64_t s = 0; s < B; ++s) {
    const int32_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0 && sl[s] >= q_len && sl[s] <= block_tables.size(1) * bs,
                "sequence ", s, ": query length ", q_len, ", context length ", sl[s], " and ",
                block_tables.size(1), " table blocks do not fit together");
  }
  const float* slopes = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.numel() == H,
                "alibi_slopes must be a contiguous float32 tensor of num_heads values");
    slopes = a.data_ptr<float>();
  }
  std::vector<float> sink_log2;  // the sinks in the log2 domain of the scores
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == H,
                "sinks must be a contiguous float32 tensor of num_heads values");
    const float* v = t.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h) sink_log2.push_back(v[h] * kLog2e);
  }
  const bool* skip = nullptr;
  if (skip_seqs.has_value()) {
    TORCH_CHECK(skip_seqs->scalar_type() == at::kBool && skip_seqs->is_contiguous() && skip_seqs->numel() == B,
                "skip_seqs must be a contiguous bool tensor with one entry per sequence");
    skip = skip_seqs->data_ptr<bool>();
  }
  const int group = int(H / kvh);

  auto launch = [&](auto tag, auto cache_tag) {
    using Tp = decltype(tag);
    using Cp = decltype(cache_tag);
    Params<Tp, Cp> p{};
    p.q = static_cast<const Tp*>(q.data_ptr());
    p.out = static_cast<Tp*>(out.data_ptr());
    p.k = static_cast<const Cp*>(k_cache.data_ptr());
    p.v = static_cast<const Cp*>(v_cache.data_ptr());
    if constexpr (std::is_same_v<Cp, Fp8E4M3>) {
      p.k_scale = k_scale->data_ptr<float>();
      p.v_scale = v_scale->data_ptr<float>();
      p.sks_b = k_scale->stride(0), p.sks_s = k_scale->stride(1), p.sks_h = k_scale->stride(2);
      p.svs_b = v_scale->stride(0), p.svs_s = v_scale->stride(1), p.svs_h = v_scale->stride(2);
    }
    p.block_tables = block_tables.data_ptr<int32_t>();
    p.seq_lens = sl;
    p.query_start_loc = qsl;
    p.slopes = slopes;
    p.sinks = sink_log2.empty() ? nullptr : sink_log2.data();
    p.qk_scale = float(scale) * kLog2e;
    p.window = int(window);
    p.softcap = float(softcap) * kLog2e;
    p.sq_t = q.stride(0), p.sq_h = q.stride(1), p.so_t = out.stride(0), p.so_h = out.stride(1);
    p.sk_b = k_cache.stride(0), p.sk_s = k_cache.stride(1), p.sk_h = k_cache.stride(2);
    p.sv_b = v_cache.stride(0), p.sv_s = v_cache.stride(1), p.sv_h = v_cache.stride(2);
    p.bt_stride = block_tables.stride(0);
    p.H = int(H), p.group = group, p.D = int(D), p.block_size = int(bs);
    p.tile_tokens = std::max(1, kTileRows / group);
    run(p, int(B), int(kvh), skip);
  };
  switch (dtype) {
    case at::kFloat: fp8 ? launch(float{}, Fp8E4M3{}) : launch(float{}, float{}); break;
    case at::kBFloat16: fp8 ? launch(c10::BFloat16{}, Fp8E4M3{}) : launch(c10::BFloat16{}, c10::BFloat16{}); break;
    case at::kHalf: fp8 ? launch(c10::Half{}, Fp8E4M3{}) : launch(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, "cpu paged attention supports float32, bfloat16 and float16, not ", dtype);
  }
}

}  // namespace

// Quantizes new keys and values ([T, kv_heads, D], float32/bfloat16/float16) into an fp8 cache: per (token, kv head)
// scale = amax / 448 (1 for an all-zero row), values x / scale as e4m3, both into the token's slot. One pass over
// the rows instead of the ~10 tensor ops (and their temporaries) of quantize_fp8 + index_copy_ per layer.
template <typename T>
void write_rows_fp8(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales, const int64_t* slots) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  const T* src = static_cast<const T*>(x.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(cache.data_ptr());
  float* sc = scales.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
#pragma omp parallel for if (T_ * H * D > 32768)
  for (int64_t r = 0; r < T_ * H; ++r) {
    const int64_t t = r / H, h = r % H;
    const T* row = src + t * st + h * sh;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(row[d])));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint8_t* out = dst + (slots[t] * H + h) * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = fp8_from_float(to_float(row[d]) / scale);  // divide: as torch does
    sc[slots[t] * H + h] = scale;
  }
}

// The slots new keys/values go to: one int64 per token, each inside the cache (checked before any write, so a bad
// slot leaves the cache untouched).
const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == num_tokens,
              "slot_mapping must be contiguous int64 with one slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the cache's ", num_slots);
  return slots;
}

void write_fp8(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [T, kv_heads, head_dim] of one dtype");
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "the head_dim axis of k and v must be contiguous");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kFloat8_e4m3fn && c->is_contiguous() && c->dim() == 4 && c->size(2) == H &&
                    c->size(3) == D, "caches must be contiguous float8_e4m3fn [num_blocks, block_size, ", H, ", ", D, "]");
  for (const at::Tensor* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() &&
                    s->numel() == k_cache.size(0) * k_cache.size(1) * H,
                "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
  const int64_t* slots = checked_slots(slot_mapping, T_, k_cache.size(0) * k_cache.size(1));
  auto both = [&](auto tag) {
    using Tp = decltype(tag);
    write_rows_fp8<Tp>(k, k_cache, k_scale, slots);
    write_rows_fp8<Tp>(v, v_cache, v_scale, slots);
  };
  switch (k.scalar_type()) {
    case at::kFloat: both(float{}); break;
    case at::kBFloat16: both(c10::BFloat16{}); break;
    case at::kHalf: both(c10::Half{}); break;
    default: TORCH_CHECK(false, "write_fp8 takes float32, bfloat16 or float16 keys/values, not ", k.scalar_type());
  }
}

// Scatters new keys/values [T, kv_heads, D] into same-dtype caches at their slots: one call for both instead of
// two index_copy_ (each ~17 us per layer in a decode step, mostly dispatch and TensorIterator set-up).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [T, kv_heads, head_dim] of one dtype");
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "the head_dim axis of k and v must be contiguous");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == k.scalar_type() && c->is_contiguous() && c->dim() == 4 && c->size(2) == H &&
                    c->size(3) == D, "caches must be contiguous [num_blocks, block_size, ", H, ", ", D, "] of k's dtype");
  const int64_t* slots = checked_slots(slot_mapping, T_, k_cache.size(0) * k_cache.size(1));
  const int64_t row = H * D * int64_t(k.element_size());
  for (const auto& [src, dst] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
    const char* s = static_cast<const char*>(src->data_ptr());
    char* d = static_cast<char*>(dst->data_ptr());
    const int64_t st = src->stride(0) * int64_t(src->element_size()), sh = src->stride(1) * int64_t(src->element_size());
    const int64_t hd = D * int64_t(src->element_size());
    for (int64_t t = 0; t < T_; ++t) {
      char* out = d + slots[t] * row;
      if (sh == hd) {
        std::memcpy(out, s + t * st, size_t(row));
      } else {
        for (int64_t h = 0; h < H; ++h) std::memcpy(out + h * hd, s + t * st + h * sh, size_t(hd));
      }
    }
  }
}

TORCH_LIBRARY(shoal_cpu_paged, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor? alibi_slopes, float scale, Tensor? skip_seqs=None, "
        "Tensor? k_scale=None, Tensor? v_scale=None, int window=0, float softcap=0.0, Tensor? sinks=None) -> ()");
}

// Switches the AVX512-BF16 path on or off; returns whether this build has it.
bool set_bf16_fast_path(bool enabled) {
  use_fast_path = enabled;
#ifdef SHOAL_AVX512_BF16
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(shoal_cpu_paged, m) { m.def("set_bf16_fast_path(bool enabled) -> bool", &set_bf16_fast_path); }

TORCH_LIBRARY_FRAGMENT(shoal_cpu_paged, m) {
  m.def("write_fp8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_fp8", &write_fp8);
  m.impl("write_kv", &write_kv);
}
