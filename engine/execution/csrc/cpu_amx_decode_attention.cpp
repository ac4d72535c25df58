// Decode attention on Intel AMX tiles: one query token per sequence; the query heads that share one cache head
// (all heads of an MLA layer, a GQA group) against that head's cached keys and values, in tile products.
//
// The generic paged kernel (cpu_paged_attention.cpp) takes one query row at a time: a vector dot product per key
// with a horizontal reduction, and values interleaved again for every row. Here one work item is (sequence, cache
// head, up to 16 of its query heads), and both products are tile products:
//   scores  S^T[keys, heads] = K[keys, D] Q^T: K's rows are A tiles (32 keys x 32 dims at a time),
//           the item's queries are packed once, in the pair ("VNNI") layout, as B tiles;
//   softmax over chunks of up to kChunk keys, lanes = heads: exact within a chunk, chunks merged online (the
//           output so far rescaled by exp(old max - new max)), so scratch stays bounded at any context length;
//   output  O[heads, V] = P V: P (bfloat16, as FlashAttention rounds it) is the A tile, the values repacked in
//           pairs of keys are B tiles, four 16-wide C tiles of output at a time.
// A half step of 16 keys that are one block's consecutive rows is loaded as an A tile in place (with the cache's
// row stride); others are gathered first. Products accumulate in float32. Keys past the context are zero rows
// with probability 0; a sliding window starts the keys at the window's first (blocks before it are never read).
//
// mla_decode: layers/mla.py's weight-absorbed queries [W_UK^T q_nope | q_pe] against one latent cache "head" of
//   [c | k_pe] per token, whose first `rank` values are also the values.
// gqa_decode: attention/cpu_paged.py's bfloat16 decode steps without ALiBi, soft-capping or sinks: query heads
//   h = g * group + i against kv head g of separate K and V caches.
// Where AMX is not built (another tier) `available` is false and callers keep the generic kernel; bfloat16 only.
// Registered as torch.ops.shoal_cpu_amx_attn.

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

constexpr int kHeads = 16;    // query heads per work item: a tile's rows
constexpr int kKeys = 32;     // keys per step: two score tiles, one bf16 A tile of probabilities
constexpr int kChunk = 1024;  // keys per softmax chunk (a multiple of kKeys)

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

// Where token p's row of one cache head starts: base + table[p / block_size] * block + (p % block_size) * entry.
struct CacheRows {
  const uint16_t* base;
  int64_t block, entry, block_size;
  const uint16_t* row(const int32_t* table, int p) const {
    return base + table[p / block_size] * block + (p % block_size) * entry;
  }
};

// One work item: nh (<= 16) query rows of D values (head stride qs), output rows of V values (stride os).
struct Item {
  const uint16_t* q;
  int64_t qs;
  uint16_t* o;
  int64_t os;
  int nh;
  const int32_t* table;
  int lo, hi;  // the keys attended: positions [lo, hi)
};

struct Scratch {
  std::vector<uint16_t> qp;    // [D / 32][16 pairs][16 heads][2]: the queries as B tiles
  std::vector<uint16_t> kg;    // [32 keys][D]: a step's keys, gathered from their blocks (zeros past the context)
  std::vector<uint16_t> zero;  // one zero row: the values of keys past the context
  std::vector<float> s;        // [kChunk][16 heads]: a chunk's scores, then probabilities
  std::vector<uint16_t> pa;    // [kChunk / 32][16 heads][32 keys]: probabilities as A tiles
  std::vector<uint16_t> vp;    // [kChunk / 32][V / 16][16 key pairs][16 values][2]: values as B tiles
  std::vector<float> c;        // [16 heads][64]: one output group of C tiles
  std::vector<float> acc;      // [16 heads][V]: the output so far, unnormalised
};

void attend(const Item& it, int D, int V, const CacheRows& keys, const CacheRows& vals, float scale, Scratch& sc) {
  const int chunks = D / 32, vgroups = V / 16, nh = it.nh;
  if (it.hi <= it.lo) {  // a padding row of a captured batch: nothing to attend to
    for (int h = 0; h < nh; ++h) std::memset(it.o + h * it.os, 0, size_t(V) * 2);
    return;
  }
  // Queries as B tiles: B[pair kk][head n][j] = q[n][32 c + 2 kk + j]; heads past nh are zero.
  sc.qp.assign(size_t(chunks) * 16 * kHeads * 2, 0);
  for (int n = 0; n < nh; ++n) {
    const uint16_t* src = it.q + n * it.qs;
    for (int d = 0; d < D; ++d) sc.qp[((size_t(d / 32) * 16 + (d % 32) / 2) * kHeads + n) * 2 + d % 2] = src[d];
  }
  sc.kg.resize(size_t(kKeys) * D);
  sc.zero.assign(V, 0);
  sc.s.resize(size_t(kChunk) * kHeads);
  sc.pa.resize(size_t(kChunk) * kHeads);
  sc.vp.resize(size_t(kChunk) * V);
  sc.c.resize(kHeads * 64);
  sc.acc.assign(size_t(kHeads) * V, 0.0f);

  // Word k of an interleave takes a[k / 2] for even k, b[k / 2] for odd k (indices >= 32 select b).
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int k = 0; k < 32; ++k) {
    lo_idx[k] = uint16_t((k & 1) * 32 + k / 2);
    hi_idx[k] = uint16_t((k & 1) * 32 + 16 + k / 2);
  }
  const __m512i idx_lo = _mm512_load_si512(lo_idx), idx_hi = _mm512_load_si512(hi_idx);
  const __m512 sc_v = _mm512_set1_ps(scale);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l = _mm512_setzero_ps();

  for (int c0 = it.lo; c0 < it.hi; c0 += kChunk) {
    const int nc = std::min(kChunk, it.hi - c0), steps = (nc + kKeys - 1) / kKeys, total = steps * kKeys;
    for (int st = 0; st < steps; ++st) {
      const int k0 = st * kKeys, n = std::min(kKeys, nc - k0);
      const uint16_t* vrow[kKeys];
      // Each half of the step's keys is an A tile: straight from the cache where its 16 keys are one block's
      // consecutive rows, else gathered (zero rows past the context).
      const uint16_t* half[2];
      int64_t half_stride[2];
      for (int hf = 0; hf < 2; ++hf) {
        const int p0 = c0 + k0 + 16 * hf;
        const bool direct = 16 * hf + 16 <= n && p0 % keys.block_size + 16 <= keys.block_size;
        for (int j = 16 * hf; j < 16 * hf + 16; ++j) {
          vrow[j] = j < n ? vals.row(it.table, c0 + k0 + j) : sc.zero.data();
          if (direct) continue;
          uint16_t* dst = sc.kg.data() + size_t(j) * D;
          if (j < n) std::memcpy(dst, keys.row(it.table, c0 + k0 + j), size_t(D) * 2);
          else std::memset(dst, 0, size_t(D) * 2);
        }
        half[hf] = direct ? keys.row(it.table, p0) : sc.kg.data() + size_t(16 * hf) * D;
        half_stride[hf] = direct ? keys.entry * 2 : int64_t(D) * 2;
      }
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < chunks; ++c) {
        _tile_loadd(4, half[0] + c * 32, half_stride[0]);
        _tile_loadd(5, half[1] + c * 32, half_stride[1]);
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
        const uint16_t *v0 = vrow[2 * jp], *v1 = vrow[2 * jp + 1];
        for (int d = 0; d < V; d += 32) {
          const __m512i a = _mm512_loadu_si512(v0 + d), b = _mm512_loadu_si512(v1 + d);
          _mm512_storeu_si512(vp + (size_t(d / 16) * 16 + jp) * 32, _mm512_permutex2var_epi16(a, idx_lo, b));
          _mm512_storeu_si512(vp + (size_t(d / 16 + 1) * 16 + jp) * 32, _mm512_permutex2var_epi16(a, idx_hi, b));
        }
      }
    }

    // This chunk's softmax, 16 heads per vector, merged with the chunks before: keys past the context weigh 0.
    __m512 mx = m;
    for (int k = 0; k < nc; ++k) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(sc.s.data() + k * kHeads), sc_v));
    const __m512 alpha = exp_approx(_mm512_sub_ps(m, mx));  // ~0 on the first chunk (m = -inf is clamped)
    m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < total; ++k) {
      float* row = sc.s.data() + size_t(k) * kHeads;
      __m512 p = _mm512_setzero_ps();
      if (k < nc) p = exp_approx(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(row), sc_v), mx));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(row, p);
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    // Probabilities as A tiles: A[head][key], bfloat16. Keys k and k+1 go out as one 32-bit pair per head.
    for (int k = 0; k < total; k += 2) {
      const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc.s.data() + size_t(k) * kHeads));
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc.s.data() + size_t(k + 1) * kHeads));
      const __m512i pairs = _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), idx_lo, _mm512_castsi256_si512(b));
      alignas(64) uint32_t w[16];
      _mm512_store_si512(w, pairs);
      uint32_t* dst = reinterpret_cast<uint32_t*>(sc.pa.data() + size_t(k / kKeys) * kHeads * kKeys) + (k % kKeys) / 2;
      for (int h = 0; h < nh; ++h) dst[h * (kKeys / 2)] = w[h];  // rows past nh: C rows nobody reads
    }
    alignas(64) float scale_old[kHeads];
    _mm512_store_ps(scale_old, alpha);

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
      _tile_stored(0, sc.c.data(), 64 * 4);
      if (ng > 1) _tile_stored(1, sc.c.data() + 16, 64 * 4);
      if (ng > 2) _tile_stored(2, sc.c.data() + 32, 64 * 4);
      if (ng > 3) _tile_stored(3, sc.c.data() + 48, 64 * 4);
      for (int h = 0; h < nh; ++h) {
        float* a = sc.acc.data() + size_t(h) * V + g * 16;
        const __m512 f = _mm512_set1_ps(scale_old[h]);
        for (int t = 0; t < ng; ++t)
          _mm512_storeu_ps(a + t * 16, _mm512_fmadd_ps(_mm512_loadu_ps(a + t * 16), f,
                                                       _mm512_loadu_ps(sc.c.data() + h * 64 + t * 16)));
      }
    }
  }

  alignas(64) float inv[kHeads];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int h = 0; h < nh; ++h) {
    const __m512 f = _mm512_set1_ps(inv[h]);
    for (int d = 0; d < V; d += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc.acc.data() + size_t(h) * V + d), f);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(it.o + h * it.os + d), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }

// Items (sequence, cache head, group of up to 16 of its `per_head` query heads) over the OpenMP threads.
template <class Run>
void for_items(int B, int cache_heads, int per_head, const Run& run) {
  const int groups = (per_head + kHeads - 1) / kHeads;
#pragma omp parallel
  {
    configure();
    thread_local Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < B * cache_heads * groups; ++i) {
      const int seq = i / (cache_heads * groups), g = (i / groups) % cache_heads, h0 = (i % groups) * kHeads;
      run(sc, seq, g, h0, std::min(kHeads, per_head - h0));
    }
    _tile_release();
  }
}
#endif

void check_tables(const at::Tensor& q, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.size(0) >= q.size(0) && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.numel() >= q.size(0),
              "block_tables [B, W] and seq_lens [B] must be contiguous int32");
}

// out[B, H, rank] = softmax(scale * q k^T) v over each sequence's cache entries, q [B, H, D] (one query token per
// sequence), cache [blocks, block_size, 1, D] whose first `rank` values are the values.
void mla_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, int64_t rank, double scale) {
  TORCH_CHECK(available(), "the AMX decode attention kernel is not available on this CPU tier");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q must be [B, H, D] bfloat16");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == 1 && cache.scalar_type() == at::kBFloat16 &&
                  cache.size(3) == q.size(2) && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "cache must be [blocks, block_size, 1, D] bfloat16 with q's D");
  TORCH_CHECK(q.size(2) % 32 == 0 && rank % 32 == 0 && rank <= q.size(2), "D and rank must be multiples of 32");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) >= rank &&
                  out.scalar_type() == at::kBFloat16 && out.stride(2) == 1, "out must be [B, H, >= rank] bfloat16");
  check_tables(q, block_tables, seq_lens);
#ifdef SHOAL_AMX
  const int D = int(q.size(2)), V = int(rank);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t ts = block_tables.size(1);
  const CacheRows rows{bits(cache), cache.stride(0), cache.stride(1), cache.size(1)};
  const uint16_t* qb = bits(q);
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for_items(int(q.size(0)), 1, int(q.size(1)), [&](Scratch& sc, int seq, int, int h0, int nh) {
    const Item it{qb + seq * q.stride(0) + h0 * q.stride(1), q.stride(1), ob + seq * out.stride(0) + h0 * out.stride(1),
                  out.stride(1), nh, tables + seq * ts, 0, lens[seq]};
    attend(it, D, V, rows, rows, float(scale), sc);
  });
#endif
}

// out[B, H, D] = softmax(scale * q k^T) v for one query token per sequence, q [B, H, D], query head h reading kv
// head h / (H / KVH) of k_cache and v_cache [blocks, block_size, KVH, D]; with window > 0 only the last `window`
// positions (a sliding window) are attended.
void gqa_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(available(), "the AMX decode attention kernel is not available on this CPU tier");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 && q.size(2) % 32 == 0,
              "q must be [B, H, D] bfloat16 with D a multiple of 32");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == at::kBFloat16 && c->size(3) == q.size(2) && c->stride(3) == 1 &&
                    c->sizes() == k_cache.sizes() && q.size(1) % c->size(2) == 0,
                "k_cache and v_cache must be [blocks, block_size, KVH, D] bfloat16 with q's D, H a multiple of KVH");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16 && out.stride(2) == 1,
              "out must be bfloat16 in q's shape");
  check_tables(q, block_tables, seq_lens);
#ifdef SHOAL_AMX
  const int D = int(q.size(2)), KVH = int(k_cache.size(2)), group = int(q.size(1)) / KVH;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t ts = block_tables.size(1);
  const uint16_t *qb = bits(q), *kb = bits(k_cache), *vb = bits(v_cache);
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for_items(int(q.size(0)), KVH, group, [&](Scratch& sc, int seq, int g, int h0, int nh) {
    const int n = lens[seq], h = g * group + h0;
    const CacheRows keys{kb + g * k_cache.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.size(1)};
    const CacheRows vals{vb + g * v_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.size(1)};
    const Item it{qb + seq * q.stride(0) + h * q.stride(1), q.stride(1), ob + seq * out.stride(0) + h * out.stride(1),
                  out.stride(1), nh, tables + seq * ts, window > 0 ? std::max(0, n - int(window)) : 0, n};
    attend(it, D, D, keys, vals, float(scale), sc);
  });
#endif
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_amx_attn, m) {
  m.def("available() -> bool", &available);
  m.def("mla_decode(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int rank, "
        "float scale) -> ()");
  m.def("gqa_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu_amx_attn, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("gqa_decode", &gqa_decode);
}
