// bfloat16 linear layers on Intel AMX: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for every M, from one weight copy
// laid out for the tiles.
//
// The weight is stored once, at load, in AMX's pair ("VNNI") layout: for each block of 16 output features and 32
// input features, 1 KiB holding p[kp][n][j] = w[16 nb + n][32 kb + 2 kp + j] (blocks ordered [N/16][K/32], so one
// block of outputs is one contiguous stream over K). That one copy serves both regimes of a decode step:
// - from kAmxMinRows activation rows on, tiles: the activation rows are an A tile as they lie in memory (rows of
//   32 bfloat16, the row stride of x), a weight block is a B tile, and one tile product is 16 x 16 x 32
//   multiply-adds; C tiles hold [rows, 16 outputs] in float32, so results leave in y's own row order;
// - below it, where tile products would be mostly padding, AVX512-BF16: a 32-bit broadcast of one activation
//   pair times a 64-byte row of the block (16 outputs x one input pair) per vdpbf16ps, no horizontal sums.
// Products and sums are float32 (as in oneDNN's bfloat16 GEMM); inputs' denormals read as zero (AMX's rule; the
// vector path follows it too, so a layer's result does not depend on the batch it ran in beyond summation order).
//
// Only built for the AMX tier (the tier's flags give -mamx-tile -mamx-bf16); elsewhere the source compiles to ops
// that report unavailable, and layers/amx_gemm.py never chooses this format. Registered as torch.ops.shoal_cpu_amx.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "amx_tiles.h"

namespace {

using shoal_amx::kBlock;
using shoal_amx::kK;
using shoal_amx::kN;
constexpr int64_t kParallelMin = 1 << 16;  // weight elements below which one thread beats a fork/join

#ifdef SHOAL_AMX
using shoal_amx::store16;
using shoal_amx::tiles_permitted;

// Rows from which tiles beat the vector path (measured on SmolLM2's and the bench model's shapes, 2 threads).
constexpr int64_t kAmxMinRows = 2;

// Tiles: 0-3 accumulators C[row group a][output half b] (a0b0, a0b1, a1b0, a1b1), 4-5 activation row groups
// (r0, r1 rows: r1 may be 0), 6-7 weight blocks.
void configure(int r0, int r1) {
  shoal_amx::TileConfig cfg;
  const int rows[2] = {r0, r1};
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) cfg.set(2 * a + b, rows[a], kN * 4);
    cfg.set(4 + a, rows[a], kK * 2);
    cfg.set(6 + a, kK / 2, kN * 4);
  }
  _tile_loadconfig(&cfg);
}

// Output blocks [nb0, nb0 + halves) (halves 1 or 2) for every activation row, 32 rows per pass. *configured: the
// row count the calling thread's tiles are set for.
void tile_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* p, const c10::BFloat16* bias,
               c10::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t nb0, int64_t halves, int64_t* configured) {
  const int64_t KB = K / kK;
  const c10::BFloat16* p0 = p + nb0 * KB * kBlock;
  const c10::BFloat16* p1 = p0 + KB * kBlock;
  const bool two = halves == 2;
  alignas(64) float c[4][16 * kN];
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, M - m0);
    const int r0 = static_cast<int>(std::min<int64_t>(16, rows)), r1 = static_cast<int>(rows - r0);
    if (*configured != rows) {
      configure(r0, r1);
      *configured = rows;
    }
    const c10::BFloat16* x0 = x + m0 * ldx;
    const c10::BFloat16* x1 = x0 + 16 * ldx;
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      _tile_loadd(4, x0 + kb * kK, ldx * 2);
      _tile_loadd(6, p0 + kb * kBlock, kN * 4);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(7, p1 + kb * kBlock, kN * 4);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (r1) {
        _tile_loadd(5, x1 + kb * kK, ldx * 2);
        _tile_dpbf16ps(2, 5, 6);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], kN * 4);
    if (two) _tile_stored(1, c[1], kN * 4);
    if (r1) {
      _tile_stored(2, c[2], kN * 4);
      if (two) _tile_stored(3, c[3], kN * 4);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = r / 16;
      for (int64_t b = 0; b < halves; ++b) {
        const int64_t n = (nb0 + b) * kN;
        store16(c[2 * a + b] + (r % 16) * kN, bias ? bias + n : nullptr, y + (m0 + r) * N + n);
      }
    }
  }
}

// The vector path for one activation row: each weight block row (16 outputs x one input pair) times the broadcast
// pair. Four accumulators, so that consecutive vdpbf16ps do not wait on each other (with one, the stream is bound by
// the instruction's latency).
void vec_row(const c10::BFloat16* x, const c10::BFloat16* p, const c10::BFloat16* bias, c10::BFloat16* y, int64_t K,
             int64_t nb) {
  constexpr int A = 4;
  const int64_t KB = K / kK;
  const c10::BFloat16* pb = p + nb * KB * kBlock;
  __m512 acc[A];
  for (int a = 0; a < A; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const c10::BFloat16* blk = pb + kb * kBlock;
    for (int64_t line = 0; line < kBlock; line += 32) __builtin_prefetch(blk + 4 * kBlock + line, 0, 3);
    for (int64_t kp = 0; kp < kK / 2; ++kp) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(blk + kp * 2 * kN);
      int32_t pair;
      std::memcpy(&pair, x + kb * kK + 2 * kp, 4);
      acc[kp % A] = _mm512_dpbf16_ps(acc[kp % A], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  alignas(64) float c[kN];
  _mm512_store_ps(c, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  store16(c, bias ? bias + nb * kN : nullptr, y + nb * kN);
}

void vec_linear(const c10::BFloat16* x, const c10::BFloat16* p, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t N, int64_t K) {
  const int64_t NB = N / kN;
  // Dynamic: a thread that starts late (woken from a passive wait, or descheduled) takes fewer blocks.
#pragma omp parallel for schedule(dynamic, 4) if (N * K >= kParallelMin && omp_get_max_threads() > 1)
  for (int64_t nb = 0; nb < NB; ++nb) vec_row(x, p, bias, y, K, nb);
}

void amx_linear(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* p, const c10::BFloat16* bias,
                c10::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  const int64_t NB = N / kN, pairs = (NB + 1) / 2;  // two output blocks per tile pass (the last may have one)
  // Beyond one pass of rows, a task takes a panel of output pairs whose weights (~128 KiB) stay in L2 while every
  // 32-row chunk of x passes over them; otherwise each pair would re-read all of x.
  const int threads = omp_get_max_threads();
  int64_t panel = 1;
  if (M > 32)
    panel = std::max<int64_t>(1, std::min<int64_t>(128 / (K / kK) + 1, pairs / (4 * threads)));
  const int64_t tasks = (pairs + panel - 1) / panel;
#pragma omp parallel if (N * K >= kParallelMin && threads > 1)
  {
    int64_t configured = -1;  // tile configs are per thread, and another library may have loaded its own
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t first = t * panel, last = std::min(pairs, first + panel);
      for (int64_t m0 = 0; m0 < M; m0 += 32)
        for (int64_t pr = first; pr < last; ++pr)
          tile_rows(x + m0 * ldx, ldx, p, bias, y + m0 * N, std::min<int64_t>(32, M - m0), N, K, 2 * pr,
                    std::min<int64_t>(2, NB - 2 * pr), &configured);
    }
    if (configured >= 0) _tile_release();
  }
}
#endif

bool available() {
#ifdef SHOAL_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] @ w^T + bias, w given as its pair layout `packed` [N/16, K/32, 16, 32] (see the top).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "shoal_cpu_amx.linear: AMX tiles are not available in this process");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "expected bfloat16 x [M, K] with a contiguous feature axis");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kN && packed.size(3) == kK,
              "expected the packed bfloat16 weight [N/16, K/32, 16, 32]");
  const int64_t M = x.size(0), N = packed.size(0) * kN, K = packed.size(1) * kK;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "bias must be contiguous bfloat16 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef SHOAL_AMX
  if (M == 0) return y;
  using B = c10::BFloat16;
  const B* xp = static_cast<const B*>(x.data_ptr());
  const B* pp = static_cast<const B*>(packed.data_ptr());
  const B* bp = bias.has_value() ? static_cast<const B*>(bias->data_ptr()) : nullptr;
  B* yp = static_cast<B*>(y.data_ptr());
  if (M >= kAmxMinRows)
    amx_linear(xp, x.stride(0), pp, bp, yp, M, N, K);
  else
    vec_linear(xp, pp, bp, yp, N, K);  // M == 1
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_amx, m) {
  m.def("available() -> bool", &available);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_amx, CPU, m) { m.impl("linear", &linear); }
