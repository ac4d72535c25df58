// Fused mixture-of-experts for CPU: every routed (token, slot) pair is grouped by expert with a counting sort, and
// each expert that received tokens runs as one batch: gather its tokens, one GEMM for gate and up together (oneDNN
// / BLAS through at::mm, plus the expert's bias where it has one), the activation — SiLU(gate) * up, or gpt-oss's
// clamped SwiGLU — one GEMM for down (plus bias), and a weighted scatter-add into the output.
//
// The torch version of the same loop (layers/moe.py, fused_experts_torch) pays ~10 dispatched ops per expert per
// layer plus an argsort; at decode batch sizes with dozens of experts that overhead is most of the MoE layer's time.
// Here it is one call per layer, in one of two ways:
//   - few rows per expert (decode): one OpenMP parallel region for the whole layer (stream_experts). Work units are
//     (expert, tile of weight rows): each thread reads its tiles' weight rows once and dots them with every row
//     routed to that expert, so the layer reads each routed expert's weights once, at memory speed, and pays one
//     fork/join instead of ~3 per expert — which also matters when the cores are shared (a thread that waits for a
//     descheduled sibling at every region costs a time slice each time).
//   - many rows per expert (prefill): per expert, GEMMs through at::mm (oneDNN / BLAS, threaded inside).
// Both round what torch would round (gate/up, the activation, down's output in the weights' dtype) so that a
// token's result does not depend on which way its batch went. Accumulation is in float32 whatever the dtype; rows of one expert are distinct
// tokens (top-k never picks an expert twice for a token), so the scatter is parallel over rows without races.
//
// GGUF files keep each projection's experts as one stack of quantized blocks: fused_experts_gguf runs the same loop
// on the packed stacks, every expert's matmuls through the packed GGUF kernels (csrc/gguf_matmul.h), so the experts
// stay at the file's size in memory.
//
// Registered as torch.ops.shoal_cpu_moe.fused_experts(_gguf); built by layers/moe.py with the same helpers and flags
// as layers/fused.py.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "fast_math.h"
#include "gguf_matmul.h"
#include "scalar_types.h"

namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements below which OpenMP's fork/join costs more than it saves

// The activation ids of layers/moe.py's ExpertActivation.KINDS.
enum Activation : int64_t { kSilu = 0, kSwigluClamped = 1 };

template <typename T>
void act_mul_rows(const at::Tensor& gate_up, at::Tensor& out, int64_t activation, float alpha, float limit) {
  const int64_t n = gate_up.size(0), inter = out.size(1);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t ld = gate_up.stride(0);
#pragma omp parallel for if (n * inter >= kParallelMin)
  for (int64_t r = 0; r < n; ++r) {
    const T* g = src + r * ld;
    const T* u = g + inter;
    T* o = dst + r * inter;
    if (activation == kSilu) {
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = static_cast<float>(g[i]);
        // Round SiLU(gate) to T before the product, as the torch reference (silu, then mul) does.
        const T s = static_cast<T>(gv / (1.0f + std::exp(-gv)));
        o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
      }
    } else {  // gpt-oss: gate clamped above, up both sides, then (up + 1) * gate * sigmoid(alpha * gate)
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = std::min(static_cast<float>(g[i]), limit);
        const float uv = std::min(std::max(static_cast<float>(u[i]), -limit), limit);
        o[i] = static_cast<T>((uv + 1.0f) * (gv / (1.0f + std::exp(-alpha * gv))));
      }
    }
  }
}

using shoal::to_float;
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }  // x as T would hold it

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 pairs of bf16 exactly and accumulates in float32 —
// no conversions, half the instructions of the generic loop. K % 32 == 0 (every model's hidden and expert widths).
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

inline void dot_rows_bf16(const c10::BFloat16* w, const c10::BFloat16* const* a, int64_t R, int64_t K, float* out) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wk = as_bh(_mm512_loadu_si512(w + k));
      s0 = _mm512_dpbf16_ps(s0, wk, as_bh(_mm512_loadu_si512(a[r] + k)));
      s1 = _mm512_dpbf16_ps(s1, wk, as_bh(_mm512_loadu_si512(a[r + 1] + k)));
      s2 = _mm512_dpbf16_ps(s2, wk, as_bh(_mm512_loadu_si512(a[r + 2] + k)));
      s3 = _mm512_dpbf16_ps(s3, wk, as_bh(_mm512_loadu_si512(a[r + 3] + k)));
    }
    out[r] = _mm512_reduce_add_ps(s0), out[r + 1] = _mm512_reduce_add_ps(s1);
    out[r + 2] = _mm512_reduce_add_ps(s2), out[r + 3] = _mm512_reduce_add_ps(s3);
  }
  for (; r < R; ++r) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
      s = _mm512_dpbf16_ps(s, as_bh(_mm512_loadu_si512(w + k)), as_bh(_mm512_loadu_si512(a[r] + k)));
    out[r] = _mm512_reduce_add_ps(s);
  }
}
#endif

// Dot products of one weight row with R activation rows (four at a time, so the weight row is converted once per
// four): out[r] = w . a_r.
template <typename T, typename A>
inline void dot_rows(const T* w, const A* const* a, int64_t R, int64_t K, float* out) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, c10::BFloat16>) {
    if (K % 32 == 0) return dot_rows_bf16(w, a, R, K, out);
  }
#endif
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    const A *a0 = a[r], *a1 = a[r + 1], *a2 = a[r + 2], *a3 = a[r + 3];
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < K; ++k) {
      const float wk = to_float(w[k]);
      s0 += wk * to_float(a0[k]);
      s1 += wk * to_float(a1[k]);
      s2 += wk * to_float(a2[k]);
      s3 += wk * to_float(a3[k]);
    }
    out[r] = s0, out[r + 1] = s1, out[r + 2] = s2, out[r + 3] = s3;
  }
  for (; r < R; ++r) {
    const A* ar = a[r];
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += to_float(w[k]) * to_float(ar[k]);
    out[r] = s;
  }
}

inline float activate(float g, float u, int64_t activation, float alpha, float limit) {
  if (activation == kSilu) return g / (1.0f + std::exp(-g)) * u;
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
}

// Inside a parallel region: out[t] = sum over token t's slots, in slot order, of weight * y[its sorted pair] (pos_of:
// each (token, slot)'s place in the expert-sorted order, -1 where another rank's expert has it).
template <typename T>
void combine_slots(const float* y, const std::vector<int64_t>& pos_of, const float* weights, int64_t tokens,
                   int64_t top_k, int64_t H, T* out) {
  std::vector<float> accum(H);
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    T* o = out + t * H;
    std::fill(accum.begin(), accum.end(), 0.f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t pos = pos_of[t * top_k + j];
      if (pos < 0) continue;  // routed to another rank's expert
      const float w = weights[t * top_k + j];
      const float* src = y + pos * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) accum[h] += w * src[h];
    }
    for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(accum[h]);
  }
}

constexpr int64_t kTileRows = 32;  // weight rows per work unit of the streaming path
// Mean rows per routed expert up to which the streaming path runs. Measured on a 2-core AVX512-BF16 Xeon, bf16,
// OLMoE's bench shape (hidden 512, 32 experts of width 512, top-4), OMP_WAIT_POLICY=passive: streaming 0.30 / 3.4 /
// 24 / 70 ms against at::mm's 0.75 / 18 / 31 / 72 ms at 1 / 16 / 64 / 256 tokens (0.1 / 2 / 8 / 32 rows per
// expert); with threads that spin-wait on shared cores the GEMM path was 5-20x slower still.
int64_t stream_max_rows = 32;

// The streaming path (see the header): experts[e] owns sorted pairs [offsets[e], offsets[e+1]); row_of[i] is the
// token of sorted pair i, slot_of[i] its (token, slot) index. Writes out [tokens, H] in T.
template <typename T>
void stream_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const T* b13, const T* b2,
                    const std::vector<int64_t>& offsets, const int64_t* row_of, const std::vector<int64_t>& pos_of,
                    const float* weights, int64_t top_k, int64_t activation, float alpha, float limit,
                    at::Tensor& out) {
  const int64_t E = w13.size(0), H = x.size(1), I = w2.size(2), tokens = x.size(0);
  const int64_t P = offsets[E];
  const T* xp = x.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  std::vector<T> act(size_t(P) * I);
  std::vector<float> y(size_t(P) * H);
  // Work units: (expert with rows, tile of weight rows) for gate/up (tiles over I) and for down (tiles over H).
  std::vector<std::pair<int64_t, int64_t>> up_units, down_units;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t n = 0; n < I; n += kTileRows) up_units.push_back({e, n});
    for (int64_t h = 0; h < H; h += kTileRows) down_units.push_back({e, h});
  }
  const int64_t n_up = int64_t(up_units.size()), n_down = int64_t(down_units.size());
  T* actp = act.data();
  float* yp = y.data();
  T* outp = out.data_ptr<T>();
#pragma omp parallel
  {
    std::vector<const T*> rows;
    std::vector<float> g, u, d;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_up; ++i) {  // act = activation(gate(x), up(x)) for one tile of I
      const auto [e, n0] = up_units[i];
      const int64_t first = offsets[e], R = offsets[e + 1] - first, n1 = std::min(I, n0 + kTileRows);
      rows.resize(R), g.resize(R), u.resize(R);
      for (int64_t r = 0; r < R; ++r) rows[r] = xp + row_of[first + r] * H;
      for (int64_t n = n0; n < n1; ++n) {
        dot_rows(w13p + (e * 2 * I + n) * H, rows.data(), R, H, g.data());
        dot_rows(w13p + (e * 2 * I + I + n) * H, rows.data(), R, H, u.data());
        const float bg = b13 ? to_float(b13[e * 2 * I + n]) : 0.f, bu = b13 ? to_float(b13[e * 2 * I + I + n]) : 0.f;
        for (int64_t r = 0; r < R; ++r) {
          const float gv = round_to<T>(g[r] + bg), uv = round_to<T>(u[r] + bu);
          float a;
          if (activation == kSilu) {  // SiLU(gate) rounded before the product, as torch's silu then mul
            a = round_to<T>(gv / (1.0f + std::exp(-gv))) * uv;
          } else {
            a = activate(gv, uv, activation, alpha, limit);
          }
          actp[(first + r) * I + n] = static_cast<T>(a);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_down; ++i) {  // y = down(act) for one tile of H
      const auto [e, h0] = down_units[i];
      const int64_t first = offsets[e], R = offsets[e + 1] - first, h1 = std::min(H, h0 + kTileRows);
      rows.resize(R), d.resize(R);
      for (int64_t r = 0; r < R; ++r) rows[r] = actp + (first + r) * I;
      for (int64_t h = h0; h < h1; ++h) {
        dot_rows(w2p + (e * H + h) * I, rows.data(), R, I, d.data());
        const float bd = b2 ? to_float(b2[e * H + h]) : 0.f;
        for (int64_t r = 0; r < R; ++r) yp[(first + r) * H + h] = round_to<T>(d[r] + bd);
      }
    }
    combine_slots(yp, pos_of, weights, tokens, top_k, H, outp);
  }
}

template <typename T>
void scatter_add_rows(const at::Tensor& y, const int64_t* slots, const float* weights, int64_t top_k,
                      float* acc, int64_t hidden) {
  const int64_t n = y.size(0);
  const T* src = y.data_ptr<T>();
#pragma omp parallel for if (n * hidden >= kParallelMin)
  for (int64_t r = 0; r < n; ++r) {
    const int64_t slot = slots[r];
    const float w = weights[slot];
    float* dst = acc + (slot / top_k) * hidden;
    const T* row = src + r * hidden;
    for (int64_t h = 0; h < hidden; ++h) dst[h] += w * static_cast<float>(row[h]);
  }
}

// The (token, slot) pairs routed to this rank's experts, grouped by local expert with a counting sort (stable: a
// token's pairs keep their order within an expert): expert e's pairs are [offsets[e], offsets[e + 1]) of `slots`
// (pair index token * top_k + k) and `rows` (the token).
struct Routing {
  std::vector<int64_t> offsets;
  at::Tensor slots, rows;
};

Routing sort_by_expert(const at::Tensor& topk_ids, int64_t num_experts, int64_t expert_start) {
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t top_k = ids.size(1), pairs = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  Routing r{std::vector<int64_t>(num_experts + 1, 0), {}, {}};
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p] - expert_start;
    if (e >= 0 && e < num_experts) ++r.offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) r.offsets[e + 1] += r.offsets[e];
  r.slots = at::empty({r.offsets[num_experts]}, ids.options());
  r.rows = at::empty({r.offsets[num_experts]}, ids.options());
  std::vector<int64_t> cursor(r.offsets.begin(), r.offsets.end() - 1);
  int64_t* s = r.slots.data_ptr<int64_t>();
  int64_t* t = r.rows.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p] - expert_start;
    if (e >= 0 && e < num_experts) {
      s[cursor[e]] = p;
      t[cursor[e]++] = p / top_k;
    }
  }
  return r;
}

// Each (token, slot) pair's place in the expert-sorted order, -1 for pairs routed to another rank's experts.
std::vector<int64_t> sorted_positions(const Routing& routing, int64_t pairs) {
  std::vector<int64_t> pos_of(pairs, -1);
  const int64_t* slot = routing.slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < routing.offsets.back(); ++i) pos_of[slot[i]] = i;
  return pos_of;
}

void check_routing(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "fused_experts: topk_ids (int64) and topk_weights (float32) must both be [tokens, top_k]");
}

// x [T, H]; w13 [E_local, 2I, H] (gate rows then up rows); w2 [E_local, H, I]; optional biases b13 [E_local, 2I] and
// b2 [E_local, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 global expert ids. Experts [expert_start,
// expert_start + E_local) are this rank's; pairs routed elsewhere contribute nothing here. Returns [T, H] in x's
// dtype.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start,
                         const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                         int64_t activation, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fused_experts: x must be a row-major [tokens, hidden] matrix");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0), "fused_experts: bad expert weights");
  TORCH_CHECK(w13.size(2) == x.size(1) && w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "fused_experts: expert weight shapes do not match the hidden size");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_experts: weights and activations must share a dtype");
  check_routing(x, topk_weights, topk_ids);
  TORCH_CHECK(activation == kSilu || activation == kSwigluClamped, "fused_experts: unknown activation ", activation);
  const int64_t tokens = x.size(0), hidden = x.size(1), num_experts = w13.size(0), inter = w2.size(2);
  for (const auto& [b, cols, name] : {std::tuple{&b13, 2 * inter, "b13"}, std::tuple{&b2, hidden, "b2"}})
    TORCH_CHECK(!b->has_value() || ((*b)->dim() == 2 && (*b)->size(0) == num_experts && (*b)->size(1) == cols &&
                                    (*b)->scalar_type() == x.scalar_type()),
                "fused_experts: ", name, " must be [experts, ", cols, "] in x's dtype");
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = sort_by_expert(topk_ids, num_experts, expert_start);
  const std::vector<int64_t>& offsets = routing.offsets;
  const at::Tensor& rows = routing.rows;

  const int64_t* slot_ptr = routing.slots.data_ptr<int64_t>();
  int64_t active = 0;
  for (int64_t e = 0; e < num_experts; ++e) active += offsets[e + 1] > offsets[e];
  if (offsets[num_experts] <= stream_max_rows * std::max<int64_t>(active, 1)) {
    const std::vector<int64_t> pos_of = sorted_positions(routing, pairs);
    at::Tensor out = at::empty({tokens, hidden}, x.options());
    const at::Tensor xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_experts", [&] {
      const at::Tensor b13c = b13.has_value() ? b13->contiguous() : at::Tensor();
      const at::Tensor b2c = b2.has_value() ? b2->contiguous() : at::Tensor();
      stream_experts<scalar_t>(xc, w13c, w2c, b13c.defined() ? b13c.data_ptr<scalar_t>() : nullptr,
                               b2c.defined() ? b2c.data_ptr<scalar_t>() : nullptr, offsets,
                               rows.data_ptr<int64_t>(), pos_of, weights.data_ptr<float>(), top_k, activation,
                               float(alpha), float(limit), out);
    });
    return out;
  }

  at::Tensor acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;  // an expert no token chose costs nothing
    const at::Tensor xe = x.index_select(0, rows.narrow(0, offsets[e], n));
    const at::Tensor gate_up = b13.has_value() ? at::addmm((*b13)[e], xe, w13[e].t()) : at::mm(xe, w13[e].t());
    at::Tensor act = at::empty({n, inter}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_experts", [&] {
      act_mul_rows<scalar_t>(gate_up, act, activation, float(alpha), float(limit));
      const at::Tensor y = b2.has_value() ? at::addmm((*b2)[e], act, w2[e].t()) : at::mm(act, w2[e].t());
      scatter_add_rows<scalar_t>(y, slot_ptr + offsets[e], weights.data_ptr<float>(), top_k, acc.data_ptr<float>(),
                                 hidden);
    });
  }
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

#ifdef SHOAL_AMX
// The experts on AMX tiles, for bfloat16 stacks kept in the tiles' pair layout (csrc/amx_tiles.h; AmxBf16Experts
// in layers/moe.py): w13p [E, 2I/16, H/32, 16, 32], w2p [E, H/16, I/32, 16, 32]. One parallel region per layer, as
// the streaming path, at every batch size: the routed rows are gathered by expert (a tile loads rows at one
// stride), then work units (expert, 32 intermediate features) run gate and up as tile products of 16 rows at a time
// with the activation applied as the tiles are read out, and units (expert, 64 hidden features) run down. A unit's
// weights (~64 KiB at OLMoE's widths) stay in L2 while an expert's row passes go over them, so each routed expert's
// weights are read from memory once per layer. Tile products are exact bf16 x bf16 in float32, and each row's sums
// run in the same order whatever else is in its batch; results are rounded where the torch reference rounds.
namespace amx_experts {

using shoal_amx::kBlock;
using shoal_amx::kK;
using shoal_amx::kN;
constexpr int64_t kRows = 16;  // activation rows per tile product (a full A tile)

// Tiles 0-3: C accumulators [16 rows, 16 outputs] float32; 4: 16 activation rows; 5-7: weight blocks.
void configure() {
  shoal_amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.set(t, kRows, kN * 4);
  cfg.set(4, kRows, kK * 2);
  for (int t = 5; t < 8; ++t) cfg.set(t, kK / 2, kN * 4);
  cfg.load();
}

// c[b] [16 rows, 16] = a [16 rows, K] (row stride lda) @ output block b (K / 32 consecutive 1 KiB blocks from
// blocks[b]), for nblk 2 or 4 blocks.
inline void product(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* const* blocks, int nblk, int64_t K,
                    float (*c)[kRows * kN]) {
  _tile_zero(0);
  _tile_zero(1);
  if (nblk == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < K / kK; ++kb) {
    _tile_loadd(4, a + kb * kK, lda * 2);
    _tile_loadd(5, blocks[0] + kb * kBlock, kN * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, blocks[1] + kb * kBlock, kN * 4);
    _tile_dpbf16ps(1, 4, 6);
    if (nblk == 4) {
      _tile_loadd(7, blocks[2] + kb * kBlock, kN * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, blocks[3] + kb * kBlock, kN * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c[0], kN * 4);
  _tile_stored(1, c[1], kN * 4);
  if (nblk == 4) {
    _tile_stored(2, c[2], kN * 4);
    _tile_stored(3, c[3], kN * 4);
  }
}

using BF = c10::BFloat16;

void run(const at::Tensor& x, const BF* w13p, const BF* w2p, const BF* b13, const BF* b2, int64_t E, int64_t I,
         const Routing& routing, const std::vector<int64_t>& pos_of, const float* weights, int64_t top_k,
         int64_t activation, float alpha, float limit, at::Tensor& out) {
  const int64_t H = x.size(1), tokens = x.size(0), ldx = x.stride(0);
  const std::vector<int64_t>& offsets = routing.offsets;
  const int64_t P = offsets[E];
  const int64_t* row_of = routing.rows.data_ptr<int64_t>();
  const BF* xp = static_cast<const BF*>(x.data_ptr());
  // Row buffers end in one tile of padding: the last pass of an expert may load rows past its own (they are
  // another expert's or stale rows; their results are never read). Kept between calls (trim_scratch).
  thread_local std::vector<BF> xs, act;
  thread_local std::vector<float> y;
  xs.resize(size_t(P + kRows) * H), act.resize(size_t(P + kRows) * I), y.resize(size_t(P) * H);
  std::vector<std::pair<int64_t, int64_t>> up_units, down_units;  // (expert, first feature)
  int64_t weight_elements = 0;  // what the layer reads: 3 H I per routed expert
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    weight_elements += 3 * H * I;
    for (int64_t n = 0; n < I; n += 2 * kN) up_units.push_back({e, n});
    for (int64_t h = 0; h < H; h += 4 * kN) down_units.push_back({e, h});
  }
  const int64_t n_up = int64_t(up_units.size()), n_down = int64_t(down_units.size());
  const int64_t up_kb = H / kK, down_kb = I / kK;  // weight blocks per output block
  BF* xsp = xs.data();
  BF* actp = act.data();
  float* yp = y.data();
#pragma omp parallel if (weight_elements >= kParallelMin * 16)
  {
    configure();  // tile configs are per thread, and another library may have loaded its own
    alignas(64) float c[4][kRows * kN];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < P; ++i) std::memcpy(xsp + i * H, xp + row_of[i] * ldx, H * sizeof(BF));
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < n_up; ++u) {  // act = activation(gate, up) for 32 intermediate features
      const auto [e, n0] = up_units[u];
      const BF* base = w13p + e * (2 * I / kN) * up_kb * kBlock;
      const BF* blocks[4] = {base + (n0 / kN) * up_kb * kBlock, base + (n0 / kN + 1) * up_kb * kBlock,
                             base + ((I + n0) / kN) * up_kb * kBlock, base + ((I + n0) / kN + 1) * up_kb * kBlock};
      const BF* bias = b13 ? b13 + e * 2 * I : nullptr;
      const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
      __m512 bg[2], bu[2];
      for (int h = 0; h < 2; ++h) {
        bg[h] = bias ? shoal_amx::load_bf16(bias + n0 + h * kN) : zero;
        bu[h] = bias ? shoal_amx::load_bf16(bias + I + n0 + h * kN) : zero;
      }
      for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += kRows) {
        product(xsp + m0 * H, H, blocks, 4, H, c);
        const int64_t rows = std::min(kRows, offsets[e + 1] - m0);
        for (int64_t r = 0; r < rows; ++r)
          for (int h = 0; h < 2; ++h) {  // gate and up rounded as their projections' outputs are, then the activation
            const __m512 g = shoal_amx::round_bf16(_mm512_add_ps(_mm512_load_ps(c[h] + r * kN), bg[h]));
            const __m512 v = shoal_amx::round_bf16(_mm512_add_ps(_mm512_load_ps(c[2 + h] + r * kN), bu[h]));
            __m512 a;
            if (activation == kSilu) {  // SiLU(gate) rounded before the product, as torch's silu then mul
              const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, shoal_amx::exp_approx(_mm512_sub_ps(zero, g))));
              a = _mm512_mul_ps(shoal_amx::round_bf16(silu), v);
            } else {
              alignas(64) float gs[kN], vs[kN];
              _mm512_store_ps(gs, g);
              _mm512_store_ps(vs, v);
              for (int64_t j = 0; j < kN; ++j) gs[j] = activate(gs[j], vs[j], activation, alpha, limit);
              a = _mm512_load_ps(gs);
            }
            _mm256_storeu_si256((__m256i*)(actp + (m0 + r) * I + n0 + h * kN), (__m256i)_mm512_cvtneps_pbh(a));
          }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < n_down; ++u) {  // y = down(act) for 64 (or the last 32) hidden features
      const auto [e, h0] = down_units[u];
      const int nblk = H - h0 >= 4 * kN ? 4 : 2;
      const BF* base = w2p + e * (H / kN) * down_kb * kBlock;
      const BF* blocks[4];
      for (int b = 0; b < nblk; ++b) blocks[b] = base + (h0 / kN + b) * down_kb * kBlock;
      for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += kRows) {
        product(actp + m0 * I, I, blocks, nblk, I, c);
        const int64_t rows = std::min(kRows, offsets[e + 1] - m0);
        for (int b = 0; b < nblk; ++b) {
          const __m512 bias = b2 ? shoal_amx::load_bf16(b2 + e * H + h0 + b * kN) : _mm512_setzero_ps();
          for (int64_t r = 0; r < rows; ++r)  // down's output rounded as torch's would be
            _mm512_storeu_ps(yp + (m0 + r) * H + h0 + b * kN,
                             shoal_amx::round_bf16(_mm512_add_ps(_mm512_load_ps(c[b] + r * kN), bias)));
        }
      }
    }
    combine_slots(yp, pos_of, weights, tokens, top_k, H, static_cast<BF*>(out.data_ptr()));
    _tile_release();
  }
  shoal_amx::trim_scratch(xs), shoal_amx::trim_scratch(act), shoal_amx::trim_scratch(y);
}

}  // namespace amx_experts
#endif

bool amx_available() {
#ifdef SHOAL_AMX
  return shoal_amx::tiles_permitted();
#else
  return false;
#endif
}

// fused_experts for bfloat16 stacks in the tiles' pair layout (see amx_experts above): x [T, H] bfloat16, w13p
// [E_local, 2I/16, H/32, 16, 32], w2p [E_local, H/16, I/32, 16, 32]; the rest as fused_experts.
at::Tensor fused_experts_amx(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p,
                             const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start,
                             const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                             int64_t activation, double alpha, double limit) {
  TORCH_CHECK(amx_available(), "fused_experts_amx: AMX tiles are not available in this process");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "fused_experts_amx: x must be a bfloat16 [tokens, hidden] matrix with a contiguous feature axis");
  for (const at::Tensor* w : {&w13p, &w2p})
    TORCH_CHECK(w->dim() == 5 && w->is_contiguous() && w->scalar_type() == at::kBFloat16 &&
                    w->size(3) == shoal_amx::kN && w->size(4) == shoal_amx::kK,
                "fused_experts_amx: expert stacks must be contiguous bfloat16 [E, N/16, K/32, 16, 32]");
  const int64_t E = w13p.size(0), H = x.size(1), I = w2p.size(2) * shoal_amx::kK;
  TORCH_CHECK(w2p.size(0) == E && w13p.size(1) * shoal_amx::kN == 2 * I && w13p.size(2) * shoal_amx::kK == H &&
                  w2p.size(1) * shoal_amx::kN == H,
              "fused_experts_amx: expert stacks do not match hidden size ", H);
  TORCH_CHECK(activation == kSilu || activation == kSwigluClamped, "fused_experts_amx: unknown activation ",
              activation);
  for (const auto& [b, cols, name] : {std::tuple{&b13, 2 * I, "b13"}, std::tuple{&b2, H, "b2"}})
    TORCH_CHECK(!b->has_value() || ((*b)->dim() == 2 && (*b)->is_contiguous() && (*b)->size(0) == E &&
                                    (*b)->size(1) == cols && (*b)->scalar_type() == at::kBFloat16),
                "fused_experts_amx: ", name, " must be contiguous bfloat16 [experts, ", cols, "]");
  check_routing(x, topk_weights, topk_ids);
  at::Tensor out = at::empty({x.size(0), H}, x.options());
#ifdef SHOAL_AMX
  if (x.size(0) == 0) return out;
  const int64_t top_k = topk_ids.size(1);
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = sort_by_expert(topk_ids, E, expert_start);
  using BF = c10::BFloat16;
  auto ptr = [](const std::optional<at::Tensor>& t) {
    return t.has_value() ? static_cast<const BF*>(t->data_ptr()) : nullptr;
  };
  amx_experts::run(x, static_cast<const BF*>(w13p.data_ptr()), static_cast<const BF*>(w2p.data_ptr()), ptr(b13),
                   ptr(b2), E, I, routing, sorted_positions(routing, topk_ids.numel()), weights.data_ptr<float>(),
                   top_k, activation, float(alpha), float(limit), out);
#endif
  return out;
}

// One projection's experts as stored in a GGUF file: stack [E_local, rows, row_bytes] uint8 of GGML type `qtype`.
struct PackedStack {
  const uint8_t* data;
  int64_t rows, row_bytes;
  int qtype;

  PackedStack(const at::Tensor& t, int64_t type, int64_t num_experts, int64_t cols, const char* what)
      : rows(t.dim() == 3 ? t.size(1) : 0), row_bytes(t.dim() == 3 ? t.size(2) : 0), qtype(static_cast<int>(type)) {
    const shoal_gguf::Format f = shoal_gguf::format_of(qtype);
    TORCH_CHECK(f.block, "fused_experts_gguf: ", what, " has unsupported GGML type id ", type);
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 3 && t.is_contiguous() &&
                    t.size(0) == num_experts && cols % f.block == 0 && row_bytes == cols / f.block * f.bytes,
                "fused_experts_gguf: ", what, " must be a contiguous uint8 stack [", num_experts, ", rows, ",
                cols / std::max(f.block, 1) * f.bytes, "] of ", cols, " columns");
    data = t.data_ptr<uint8_t>();
  }
  shoal_gguf::Segment expert(int64_t e, int64_t first) const {
    return {data + e * rows * row_bytes, row_bytes, rows, first, qtype};
  }
};

// The fused_experts loop with packed GGUF expert stacks: gate, up [E_local, I, *] and down [E_local, H, *], each
// projection its own GGML type. Every expert with tokens: gate and up in one packed matmul of its gathered tokens,
// SiLU(gate) * up, down, weighted scatter-add; all in float32 (whatever x's dtype), scratch reused across calls.
at::Tensor fused_experts_gguf(const at::Tensor& x_in, const at::Tensor& gate, const at::Tensor& up,
                              const at::Tensor& down, int64_t gate_type, int64_t up_type, int64_t down_type,
                              const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "fused_experts_gguf: x must be a CPU [tokens, hidden]");
  check_routing(x_in, topk_weights, topk_ids);
  const int64_t tokens = x_in.size(0), hidden = x_in.size(1), num_experts = gate.size(0);
  const PackedStack g(gate, gate_type, num_experts, hidden, "gate");
  const PackedStack u(up, up_type, num_experts, hidden, "up");
  const int64_t inter = g.rows;
  const PackedStack d(down, down_type, num_experts, inter, "down");
  TORCH_CHECK(u.rows == inter && d.rows == hidden, "fused_experts_gguf: gate and up need I rows each, down H rows");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  const int64_t top_k = topk_ids.size(1);
  const at::Tensor weights = topk_weights.contiguous();
  const float* wp = weights.data_ptr<float>();
  const Routing routing = sort_by_expert(topk_ids, num_experts, expert_start);
  const int64_t* slot = routing.slots.data_ptr<int64_t>();
  const int64_t* row = routing.rows.data_ptr<int64_t>();

  at::Tensor acc = at::zeros({tokens, hidden}, x.options());
  float* out = acc.data_ptr<float>();
  thread_local std::vector<float> xe, gate_up, act, ye;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = routing.offsets[e], n = routing.offsets[e + 1] - first;
    if (n == 0) continue;  // an expert no token chose costs nothing
    xe.resize(n * hidden);
    for (int64_t i = 0; i < n; ++i) std::copy_n(xp + row[first + i] * hidden, hidden, &xe[i * hidden]);
    gate_up.resize(n * 2 * inter);
    shoal_gguf::packed_matmul(xe.data(), n, hidden, {g.expert(e, 0), u.expert(e, inter)}, 2 * inter, nullptr,
                              gate_up.data());
    act.resize(n * inter);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < inter; ++j) {
        const float gv = gate_up[i * 2 * inter + j];
        act[i * inter + j] = gv / (1.0f + std::exp(-gv)) * gate_up[i * 2 * inter + inter + j];
      }
    ye.resize(n * hidden);
    shoal_gguf::packed_matmul(act.data(), n, inter, {d.expert(e, 0)}, hidden, nullptr, ye.data());
    for (int64_t i = 0; i < n; ++i) {  // distinct tokens within an expert: no two rows write the same output
      const float w = wp[slot[first + i]];
      float* dst = out + row[first + i] * hidden;
      for (int64_t h = 0; h < hidden; ++h) dst[h] += w * ye[i * hidden + h];
    }
  }
  return x_in.scalar_type() == at::kFloat ? acc : acc.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_moe, m) {
  m.def("fused_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int expert_start, "
        "Tensor? b13=None, Tensor? b2=None, int activation=0, float alpha=1.702, float limit=7.0) -> Tensor");
  m.def("fused_experts_gguf(Tensor x, Tensor gate, Tensor up, Tensor down, int gate_type, int up_type, "
        "int down_type, Tensor topk_weights, Tensor topk_ids, int expert_start) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
  m.def("fused_experts_amx(Tensor x, Tensor w13p, Tensor w2p, Tensor topk_weights, Tensor topk_ids, "
        "int expert_start, Tensor? b13=None, Tensor? b2=None, int activation=0, float alpha=1.702, "
        "float limit=7.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_moe, CPU, m) {
  m.impl("fused_experts", &fused_experts);
  m.impl("fused_experts_amx", &fused_experts_amx);
  m.impl("fused_experts_gguf", &fused_experts_gguf);
}

// The rows-per-expert threshold of the streaming path (tests cover both paths, benchmarks compare them); returns
// the previous value.
int64_t set_stream_max_rows(int64_t rows) {
  const int64_t previous = stream_max_rows;
  stream_max_rows = rows;
  return previous;
}

TORCH_LIBRARY_FRAGMENT(shoal_cpu_moe, m) { m.def("set_stream_max_rows(int rows) -> int", &set_stream_max_rows); }
