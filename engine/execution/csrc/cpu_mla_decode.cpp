// MLA decode attention on Intel AMX: one query token per sequence, all its heads against the sequence's latent
// cache entries (layers/mla.py: weight-absorbed queries [W_UK^T q_nope | q_pe] of rank + rope values; one cache
// "head" of [c | k_pe] per token, whose first `rank` values are also the values).
//
// The generic paged kernel (cpu_paged_attention.cpp) runs this as multi-query attention with 1 key head: per query
// row a dot product per key with a horizontal sum, and values interleaved from a second read of the same rows. Here
// one work item is (sequence, group of 16 heads), and both products are tile products:
//   scores  S^T[keys, heads] = K[keys, D] Q^T: K's rows are an A tile as gathered (32 keys x 32 values at a time),
//           the group's queries are packed once, in the pair ("VNNI") layout, as B tiles;
//   softmax exact over the whole context (it is short enough to keep: ctx x 16 floats), lanes = heads;
//   output  O[heads, rank] = P V: P (bfloat16, as FlashAttention rounds it) is the A tile, V = the entries' first
//           `rank` values repacked in pairs of keys as B tiles, four 16-wide C tiles of output at a time.
// Products accumulate in float32. Keys past the context are zero rows with probability 0. Where AMX is not built
// (another tier) the op reports unavailable and layers/mla.py keeps the generic kernel; bfloat16 caches only.
// Registered as torch.ops.shoal_cpu_mla.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int kHeads = 16;  // heads per work item: a tile's rows
constexpr int kKeys = 32;   // keys per step: two score tiles, one bf16 A tile of probabilities

bool available() {
#ifdef SHOAL_AMX
  return shoal_amx::tiles_permitted();
#else
  return false;
#endif
}

#ifdef SHOAL_AMX
using shoal_amx::exp_approx;

// Every tile is 16 rows of 64 bytes: 0-3 accumulators, 4-5 A (keys, or probabilities), 6 B.
void configure() {
  shoal_amx::TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.set(t, 16, 64);
  cfg.load();
}

struct Scratch {
  std::vector<uint16_t> qp;   // [D / 32][16 pairs][16 heads][2]: the queries as B tiles
  std::vector<uint16_t> kg;   // [32 keys][D]: a step's keys, gathered from their blocks (zeros past the context)
  std::vector<float> s;       // [ctx_pad][16 heads]: scores, then probabilities
  std::vector<uint16_t> pa;   // [ctx_pad / 32][16 heads][32 keys]: probabilities as A tiles
  std::vector<uint16_t> vp;   // [ctx_pad / 32][rank / 16][16 key pairs][16 values][2]: values as B tiles
  std::vector<float> c;       // [16 heads][64]: one output group of C tiles
};

void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int32_t* table,
            int64_t table_stride, int seq, int ctx, int h0, int nh, int rank, float scale, Scratch& sc) {
  const int D = int(q.size(2));
  const int64_t bs = cache.size(1), entry = cache.stride(1), block = cache.stride(0);
  const auto* qrow = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()) + seq * q.stride(0);
  const auto* base = reinterpret_cast<const uint16_t*>(cache.data_ptr<c10::BFloat16>());
  const int steps = (ctx + kKeys - 1) / kKeys, chunks = D / 32, vgroups = rank / 16;
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + seq * out.stride(0);
  if (ctx <= 0) {  // a padding row of a captured batch: nothing to attend to
    for (int h = 0; h < nh; ++h) std::memset(o + int64_t(h0 + h) * out.stride(1), 0, size_t(rank) * 2);
    return;
  }

  // Queries as B tiles: B[pair kk][head n][j] = q[h0 + n][32 c + 2 kk + j]; heads past nh are zero.
  sc.qp.assign(size_t(chunks) * 16 * kHeads * 2, 0);
  for (int n = 0; n < nh; ++n) {
    const uint16_t* src = qrow + int64_t(h0 + n) * q.stride(1);
    for (int d = 0; d < D; ++d) sc.qp[((size_t(d / 32) * 16 + (d % 32) / 2) * kHeads + n) * 2 + d % 2] = src[d];
  }
  sc.s.resize(size_t(steps) * kKeys * kHeads);
  sc.pa.resize(size_t(steps) * kHeads * kKeys);
  sc.vp.resize(size_t(steps) * vgroups * 16 * 16 * 2);
  sc.kg.resize(size_t(kKeys) * D);

  // Word k of an interleave takes a[k / 2] for even k, b[k / 2] for odd k (indices >= 32 select b).
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int k = 0; k < 32; ++k) {
    lo_idx[k] = uint16_t((k & 1) * 32 + k / 2);
    hi_idx[k] = uint16_t((k & 1) * 32 + 16 + k / 2);
  }
  const __m512i idx_lo = _mm512_load_si512(lo_idx), idx_hi = _mm512_load_si512(hi_idx);

  for (int st = 0; st < steps; ++st) {
    const int k0 = st * kKeys, n = std::min(kKeys, ctx - k0);
    for (int j = 0; j < kKeys; ++j) {  // gather this step's entries (zero rows past the context)
      uint16_t* dst = sc.kg.data() + size_t(j) * D;
      if (j < n) {
        const int p = k0 + j;
        std::memcpy(dst, base + table[p / bs] * block + (p % bs) * entry, size_t(D) * 2);
      } else {
        std::memset(dst, 0, size_t(D) * 2);
      }
    }
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(4, sc.kg.data() + c * 32, D * 2);
      _tile_loadd(5, sc.kg.data() + 16 * D + c * 32, D * 2);
      _tile_loadd(6, sc.qp.data() + size_t(c) * 16 * kHeads * 2, kHeads * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
    }
    float* s = sc.s.data() + size_t(k0) * kHeads;
    _tile_stored(0, s, kHeads * 4);
    _tile_stored(1, s + 16 * kHeads, kHeads * 4);
    // Values as B tiles: for 16 values at a time, B[key pair jp][value v][j] = V[2 jp + j][16 g + v].
    uint16_t* vp = sc.vp.data() + size_t(st) * vgroups * 512;
    for (int jp = 0; jp < 16; ++jp) {
      const uint16_t* v0 = sc.kg.data() + size_t(2 * jp) * D;
      const uint16_t* v1 = v0 + D;
      for (int d = 0; d < rank; d += 32) {
        const __m512i a = _mm512_loadu_si512(v0 + d), b = _mm512_loadu_si512(v1 + d);
        _mm512_storeu_si512(vp + (size_t(d / 16) * 16 + jp) * 32, _mm512_permutex2var_epi16(a, idx_lo, b));
        _mm512_storeu_si512(vp + (size_t(d / 16 + 1) * 16 + jp) * 32, _mm512_permutex2var_epi16(a, idx_hi, b));
      }
    }
  }

  // Exact softmax over the context, 16 heads per vector; keys past it weigh 0.
  const int total = steps * kKeys;
  const __m512 sc_v = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int k = 0; k < ctx; ++k) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(sc.s.data() + k * kHeads), sc_v));
  __m512 sum = _mm512_setzero_ps();
  for (int k = 0; k < total; ++k) {
    float* row = sc.s.data() + size_t(k) * kHeads;
    __m512 p = _mm512_setzero_ps();
    if (k < ctx) p = exp_approx(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(row), sc_v), mx));
    sum = _mm512_add_ps(sum, p);
    _mm512_storeu_ps(row, p);
  }
  // Probabilities as A tiles: A[head][key], bfloat16. Keys k and k+1 go out as one 32-bit pair per head.
  for (int k = 0; k < total; k += 2) {
    const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc.s.data() + size_t(k) * kHeads));
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc.s.data() + size_t(k + 1) * kHeads));
    const __m512i pairs = _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), idx_lo, _mm512_castsi256_si512(b));
    alignas(64) uint32_t w[16];
    _mm512_store_si512(w, pairs);
    uint32_t* dst = reinterpret_cast<uint32_t*>(sc.pa.data() + size_t(k / kKeys) * kHeads * kKeys) + (k % kKeys) / 2;
    for (int h = 0; h < kHeads; ++h) dst[h * (kKeys / 2)] = w[h];
  }
  alignas(64) float inv[kHeads];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));

  for (int g = 0; g < vgroups; g += 4) {
    const int ng = std::min(4, vgroups - g);
    _tile_zero(0);  // tile numbers are immediates: one statement each
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int st = 0; st < steps; ++st) {
      _tile_loadd(4, sc.pa.data() + size_t(st) * kHeads * kKeys, kKeys * 2);
      const uint16_t* vp = sc.vp.data() + size_t(st) * vgroups * 512;
      _tile_loadd(6, vp + size_t(g) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (ng > 1) { _tile_loadd(6, vp + size_t(g + 1) * 512, 64); _tile_dpbf16ps(1, 4, 6); }
      if (ng > 2) { _tile_loadd(6, vp + size_t(g + 2) * 512, 64); _tile_dpbf16ps(2, 4, 6); }
      if (ng > 3) { _tile_loadd(6, vp + size_t(g + 3) * 512, 64); _tile_dpbf16ps(3, 4, 6); }
    }
    sc.c.resize(kHeads * 64);
    _tile_stored(0, sc.c.data(), 64 * 4);
    if (ng > 1) _tile_stored(1, sc.c.data() + 16, 64 * 4);
    if (ng > 2) _tile_stored(2, sc.c.data() + 32, 64 * 4);
    if (ng > 3) _tile_stored(3, sc.c.data() + 48, 64 * 4);
    for (int h = 0; h < nh; ++h) {
      uint16_t* dst = o + int64_t(h0 + h) * out.stride(1) + g * 16;
      const __m512 f = _mm512_set1_ps(inv[h]);
      for (int t = 0; t < ng; ++t) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc.c.data() + h * 64 + t * 16), f);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 16), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}
#endif

// out[B, H, rank] = softmax(scale * q k^T) v over each sequence's cache entries, q [B, H, D] (one query token per
// sequence), cache [blocks, block_size, 1, D] whose first `rank` values are the values.
void mla_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, int64_t rank, double scale) {
  TORCH_CHECK(available(), "the AMX MLA decode kernel is not available on this CPU tier");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q must be [B, H, D] bfloat16");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == 1 && cache.scalar_type() == at::kBFloat16 &&
                  cache.size(3) == q.size(2) && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "cache must be [blocks, block_size, 1, D] bfloat16 with q's D");
  TORCH_CHECK(q.size(2) % 32 == 0 && rank % 32 == 0 && rank <= q.size(2), "D and rank must be multiples of 32");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) >= rank &&
                  out.scalar_type() == at::kBFloat16 && out.stride(2) == 1, "out must be [B, H, >= rank] bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.numel() == q.size(0),
              "block_tables [B, W] and seq_lens [B] must be int32");
#ifdef SHOAL_AMX
  const int B = int(q.size(0)), H = int(q.size(1)), groups = (H + kHeads - 1) / kHeads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t ts = block_tables.size(1);
#pragma omp parallel
  {
    configure();
    thread_local Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < B * groups; ++i) {
      const int seq = i / groups, h0 = (i % groups) * kHeads;
      attend(out, q, cache, tables + int64_t(seq) * ts, ts, seq, lens[seq], h0, std::min(kHeads, H - h0), int(rank),
             float(scale), sc);
    }
    _tile_release();
  }
#endif
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_mla, m) {
  m.def("available() -> bool", &available);
  m.def("mla_decode(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int rank, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu_mla, CPU, m) { m.impl("mla_decode", &mla_decode); }
