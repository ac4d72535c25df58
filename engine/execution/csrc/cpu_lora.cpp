// Gathered low-rank (LoRA) update of a linear layer's output for a batch that mixes adapters:
//   y[t] += (x[t] @ A[s]^T) @ B[s]   for every token t whose adapter slot s = slots[t] >= 0 (-1: the base model).
// A: [S, P*R, in] (each slot's down-projections, one block of R rows per part of a fused projection: q/k/v or
// gate/up), B: [S, P*R, out] (the up-projections, transposed, scale folded in). ranks [S, P]: rows used in each
// part's block (an adapter of rank 8 in rank-64 slots reads 8 rows, not 64; 0: the adapter skips that part).
// part_cols [P + 1]: the output columns of part p are [part_cols[p], part_cols[p + 1]), the only columns its B
// rows write, so a q/k/v update reads q's B only over q's columns.
//
// As vLLM's punica SGMV: tokens are grouped by slot (a counting sort), then each adapter's group is a shrink
// (h = x_g A_s^T, float32) and an expand (y_g += h B_s): no loop over tokens in Python, no torch op per slot, no
// temporaries (the float32 buffers are reused from call to call). Both loops read each A and B row once per block
// of up to 8 tokens and keep those tokens' partial sums in registers: a decode step has a few tokens per adapter,
// so its cost is one pass over the active adapters' weights; a prefill chunk reuses each weight 8 times. (ATen's
// GEMMs on gathered rows were 2-4x slower here even for prefill-sized groups: their ranks are too thin.) OpenMP
// splits the shrink by (adapter, A row) and the expand by (adapter, part, block of output columns). A decode step
// then streams the active adapters' weights at the memory's pace (measured: each half, shrink and expand, reads its
// bytes at the single-thread streaming rate), which is the floor for it. The bfloat16 build of the AVX512-BF16 tier
// dots A and x with vdpbf16ps (below); every other build and dtype runs the portable vector code.
//
// Numerics: products and sums in float32, y rounded to its dtype once (y + update); the masked torch form
// (execution/lora.py) is the test oracle.
// Registered as torch.ops.shoal_cpu_lora.lora_apply_ (in place on y).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "scalar_types.h"

namespace {

constexpr int64_t kColBlock = 256;     // output columns per expand work item
constexpr int64_t kGemmMin = 48;     // tokens of one adapter from which ATen's GEMMs take over
constexpr int64_t kParallelMin = 1 << 17;  // multiply-adds below which OpenMP's fork/join costs more than it saves

using shoal::from_float;
using shoal::to_float;

struct Group {  // one adapter's tokens: rows [begin, end) of the sorted order
  int64_t slot, begin, end;
};

struct Item {  // a work item: shrink (group, part, A row) or expand (group, part, first output column)
  int64_t g, p, i;
};

// Reused between calls (one engine thread calls these kernels): no allocation per layer once warm. Parallel
// regions reach them through plain pointers and references taken on the calling thread.
thread_local std::vector<int64_t> t_order, t_count, t_next;
thread_local std::vector<float> t_xs, t_h;
thread_local std::vector<Item> t_shrink, t_expand;
thread_local std::vector<Group> t_groups;

// The two loops below keep NB tokens' partial sums in 16-float vectors (GCC/Clang vector extensions: one register
// at AVX-512, two at AVX2, four at SSE or NEON), so each weight element is loaded and converted once per NB
// tokens. NB is a template argument: a decode step's 1-3 tokens per adapter run NB = 1, 2 or 4, not a padded block.
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load16(const c10::BFloat16* p) {
  vu16 half;
  std::memcpy(&half, p, sizeof half);
  const vu32 bits = __builtin_convertvector(half, vu32) << 16;  // bfloat16 is the top half of a float32
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline vf load16(const c10::Half* p) {
  alignas(64) float f[kLanes];
  for (int l = 0; l < kLanes; ++l) f[l] = static_cast<float>(p[l]);
  return load16(f);
}
inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store16(c10::BFloat16* p, vf v) {  // round to nearest even, NaN kept quiet: as c10::BFloat16(float)
  vu32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vu32 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  const vu32 nan = reinterpret_cast<vu32>(v != v);  // all ones where v is NaN
  const vu16 out = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vu16);
  std::memcpy(p, &out, sizeof out);
}
inline void store16(c10::Half* p, vf v) {
  alignas(64) float f[kLanes];
  store16(f, v);
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<c10::Half>(f[l]);
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// out[j * out_stride] = x_j . a (j < NB) over n_in inputs.
template <int NB, typename T>
inline void dot_block(const float* const* xr, const T* a, int64_t n_in, float* out, int64_t out_stride) {
  vf acc[NB] = {};
  int64_t k = 0;
  for (; k + kLanes <= n_in; k += kLanes) {
    const vf av = load16(a + k);
    for (int j = 0; j < NB; ++j) acc[j] += av * load16(xr[j] + k);
  }
  for (int j = 0; j < NB; ++j) {
    float sum = hsum(acc[j]);
    for (int64_t kk = k; kk < n_in; ++kk) sum += to_float(a[kk]) * xr[j][kk];
    out[j * out_stride] = sum;
  }
}

#if defined(__AVX512BF16__)
// The same dots for bfloat16 on CPUs with AVX512-BF16 (this file's build for that tier): vdpbf16ps multiplies
// pairs of bfloat16 straight from A and x into float32 sums, 32 products an instruction and no conversion: half the
// shrink's instructions. The products are exact as in the float32 form; the sums are float32 (denormals flushed).
constexpr bool kDpBf16 = true;
template <int NB>
inline void dot_block_bf16(const c10::BFloat16* const* xr, const c10::BFloat16* a, int64_t n_in, float* out,
                           int64_t out_stride) {
  __m512 acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n_in; k += 32) {
    const __m512bh av = (__m512bh)_mm512_loadu_si512(a + k);
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_loadu_si512(xr[j] + k));
  }
  for (int j = 0; j < NB; ++j) {
    float sum = _mm512_reduce_add_ps(acc[j]);
    for (int64_t kk = k; kk < n_in; ++kk) sum += to_float(a[kk]) * to_float(xr[j][kk]);
    out[j * out_stride] = sum;
  }
}
#else
constexpr bool kDpBf16 = false;
#endif

// y_j[c] += sum_i h_j[i] * b[i][c] (j < NB, i < rank, c < nc): b's rows are n_out apart, h_j's rows h_stride.
template <int NB, typename T>
inline void axpy_block(const float* h, int64_t h_stride, const T* b, int64_t n_out, int64_t rank, int64_t nc,
                       T* const* yr) {
  int64_t c = 0;
  for (; c + kLanes <= nc; c += kLanes) {
    vf acc[NB] = {};
    for (int64_t i = 0; i < rank; ++i) {
      const vf bv = load16(b + i * n_out + c);
      for (int j = 0; j < NB; ++j) acc[j] += h[j * h_stride + i] * bv;
    }
    for (int j = 0; j < NB; ++j) store16(yr[j] + c, load16(yr[j] + c) + acc[j]);
  }
  for (; c < nc; ++c) {
    for (int j = 0; j < NB; ++j) {
      float sum = 0.f;
      for (int64_t i = 0; i < rank; ++i) sum += h[j * h_stride + i] * to_float(b[i * n_out + c]);
      yr[j][c] = from_float<T>(to_float(yr[j][c]) + sum);
    }
  }
}

// Runs f.template operator()<NB>(first token, NB) over n tokens in blocks of 8, then one each of 4, 2, 1.
template <typename F>
inline void token_blocks(int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) f(std::integral_constant<int, 8>{}, j);
  if (j + 4 <= n) f(std::integral_constant<int, 4>{}, j), j += 4;
  if (j + 2 <= n) f(std::integral_constant<int, 2>{}, j), j += 2;
  if (j < n) f(std::integral_constant<int, 1>{}, j);
}

template <typename T>
void lora_impl(T* y, const T* x, const T* A, const T* B, const int64_t* ranks, const int64_t* part_cols,
               int64_t P, int64_t R, int64_t n_in, int64_t n_out, int64_t sy, int64_t sx,
               const std::vector<Group>& groups) {
  const int64_t PR = P * R;
  const int64_t* order = t_order.data();
  const int64_t n_rows = groups.back().end;
  // bfloat16 dots read x as it is (kDpBf16); the other forms read it converted to float32
  constexpr bool dp = kDpBf16 && std::is_same_v<T, c10::BFloat16>;
  // The groups' x rows in float32, in sorted order (contiguous per adapter), and their low-rank activations.
  t_xs.resize(dp ? 0 : static_cast<size_t>(n_rows * n_in));
  t_h.resize(static_cast<size_t>(n_rows * PR));
  float* xs = t_xs.data();
  float* h = t_h.data();

  auto& shrink = t_shrink;
  auto& expand = t_expand;
  shrink.clear();
  expand.clear();
  int64_t macs = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    const Group& grp = groups[g];
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r = std::min(ranks[grp.slot * P + p], R);
      if (r <= 0) continue;
      for (int64_t i = 0; i < r; ++i) shrink.push_back({g, p, p * R + i});
      for (int64_t c = part_cols[p]; c < part_cols[p + 1]; c += kColBlock) expand.push_back({g, p, c});
      macs += (grp.end - grp.begin) * r * (n_in + part_cols[p + 1] - part_cols[p]);
    }
  }
  const bool parallel = macs >= kParallelMin && omp_get_max_threads() > 1;

#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < (dp ? 0 : n_rows); ++j) {
      const T* src = x + order[j] * sx;
      float* dst = xs + j * n_in;
#pragma omp simd
      for (int64_t k = 0; k < n_in; ++k) dst[k] = to_float(src[k]);
    }
    // Shrink: one A row per item, dotted with every token of its group.
#pragma omp for schedule(static)
    for (size_t w = 0; w < shrink.size(); ++w) {
      const Item& it = shrink[w];
      const Group& grp = groups[it.g];
      const T* a = A + (grp.slot * PR + it.i) * n_in;
      token_blocks(grp.end - grp.begin, [&](auto nb, int64_t j) {
        constexpr int NB = decltype(nb)::value;
        float* out = h + (grp.begin + j) * PR + it.i;
#if defined(__AVX512BF16__)
        if constexpr (dp) {
          const c10::BFloat16* xr[NB];
          for (int q = 0; q < NB; ++q) xr[q] = x + order[grp.begin + j + q] * sx;
          dot_block_bf16<NB>(xr, a, n_in, out, PR);
          return;
        }
#endif
        const float* xr[NB];
        for (int q = 0; q < NB; ++q) xr[q] = xs + (grp.begin + j + q) * n_in;
        dot_block<NB, T>(xr, a, n_in, out, PR);
      });
    }
    // Expand: one block of a part's output columns per item, for every token of its group.
#pragma omp for schedule(static)
    for (size_t w = 0; w < expand.size(); ++w) {
      const Item& it = expand[w];
      const Group& grp = groups[it.g];
      const int64_t c0 = it.i, nc = std::min(kColBlock, part_cols[it.p + 1] - c0);
      const int64_t r = std::min(ranks[grp.slot * P + it.p], R);
      const T* b = B + (grp.slot * PR + it.p * R) * n_out + c0;
      token_blocks(grp.end - grp.begin, [&](auto nb, int64_t j) {
        constexpr int NB = decltype(nb)::value;
        T* yr[NB];
        for (int q = 0; q < NB; ++q) yr[q] = y + order[grp.begin + j + q] * sy + c0;
        axpy_block<NB, T>(h + (grp.begin + j) * PR + it.p * R, PR, b, n_out, r, nc, yr);
      });
    }
  }
}

void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& slots, const at::Tensor& ranks, const at::Tensor& part_cols) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_apply_: x [T, in], y [T, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_apply_: x and y need contiguous rows");
  TORCH_CHECK(A.dim() == 3 && B.dim() == 3 && A.size(0) == B.size(0) && A.size(1) == B.size(1),
              "lora_apply_: A [S, P*R, in], B [S, P*R, out]");
  TORCH_CHECK(A.is_contiguous() && B.is_contiguous(), "lora_apply_: A and B must be contiguous");
  TORCH_CHECK(A.size(2) == x.size(1) && B.size(2) == y.size(1), "lora_apply_: A/B do not match x/y");
  const auto dtype = y.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && A.scalar_type() == dtype && B.scalar_type() == dtype,
              "lora_apply_: x, y, A and B must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(), "lora_apply_: slots must be contiguous int64 [T]");
  const int64_t S = A.size(0), n_tokens = x.size(0), n_out = y.size(1);
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == S && ranks.scalar_type() == at::kLong && ranks.is_contiguous(),
              "lora_apply_: ranks must be contiguous int64 [S, P]");
  const int64_t P = ranks.size(1);
  TORCH_CHECK(P >= 1 && A.size(1) % P == 0, "lora_apply_: A's rows do not split into ", P, " parts");
  TORCH_CHECK(part_cols.dim() == 1 && part_cols.size(0) == P + 1 && part_cols.scalar_type() == at::kLong &&
                  part_cols.is_contiguous(), "lora_apply_: part_cols must be contiguous int64 [P + 1]");
  const int64_t* pc = part_cols.data_ptr<int64_t>();
  TORCH_CHECK(pc[0] == 0 && pc[P] == n_out, "lora_apply_: part_cols must run from 0 to out");
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(pc[p] <= pc[p + 1], "lora_apply_: part_cols must not decrease");

  // Counting sort of the tokens by slot.
  const int64_t* sp = slots.data_ptr<int64_t>();
  t_count.assign(static_cast<size_t>(S), 0);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t s = sp[t];
    TORCH_CHECK(s >= -1 && s < S, "lora_apply_: slot ", s, " out of range [-1, ", S, ")");
    if (s >= 0) ++t_count[s];
  }
  // The groups in slot order, and the token order that makes each group's rows contiguous.
  auto& groups = t_groups;
  groups.clear();
  int64_t n_rows = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = t_count[s];
    if (n > 0) groups.push_back({s, n_rows, n_rows + n}), n_rows += n;
  }
  if (groups.empty()) return;
  t_order.resize(static_cast<size_t>(n_rows));
  t_next.assign(static_cast<size_t>(S), 0);
  for (const auto& g : groups) t_next[g.slot] = g.begin;
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (sp[t] >= 0) t_order[t_next[sp[t]]++] = t;
  }
  const int64_t R = A.size(1) / P;
  const int64_t* rk = ranks.data_ptr<int64_t>();
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    lora_impl<T>(static_cast<T*>(y.data_ptr()), static_cast<const T*>(x.data_ptr()),
                 static_cast<const T*>(A.data_ptr()), static_cast<const T*>(B.data_ptr()), rk, pc, P, R, x.size(1),
                 n_out, y.stride(0), x.stride(0), groups);
  };
  if (dtype == at::kFloat) launch(float{});
  else if (dtype == at::kBFloat16) launch(c10::BFloat16{});
  else if (dtype == at::kHalf) launch(c10::Half{});
  else TORCH_CHECK(false, "lora_apply_ supports float32/bfloat16/float16, got ", dtype);
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_lora, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor slots, Tensor ranks, Tensor part_cols) -> ()",
        &lora_apply_);
}
