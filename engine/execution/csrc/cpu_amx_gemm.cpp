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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

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
  cfg.load();
}

// The two kinds of tile product: bfloat16 pairs into float32 (TDPBF16PS) and signed int8 quads into int32
// (TDPBSSD). Both use the same geometry (an A tile row and a B tile row are 64 bytes, a weight block 1 KiB), so
// the tile configuration and the loops below serve both.
struct Bf16Tiles {
  using In = c10::BFloat16;
  using Acc = float;
  static constexpr int64_t kDepth = kK;  // inputs per block
  static constexpr bool kInt8 = false;
};
struct Int8Tiles {
  using In = int8_t;
  using Acc = int32_t;
  static constexpr int64_t kDepth = 64;
  static constexpr bool kInt8 = true;
};
// C += A B for Kind's element type (a macro: GCC's tile intrinsics paste their tile numbers into the assembly, so
// they must be literals, not template parameters).
#define SHOAL_TILE_PRODUCT(Kind, C, A, B) \
  do {                                     \
    if constexpr (Kind::kInt8)             \
      _tile_dpbssd(C, A, B);               \
    else                                   \
      _tile_dpbf16ps(C, A, B);             \
  } while (0)

// Output blocks [nb0, nb0 + halves) (halves 1 or 2) for every activation row, 32 rows per pass; each finished C
// row of 16 outputs goes to epilogue(acc, row, first output). *configured: the row count the calling thread's tiles
// are set for.
template <class Kind, class Epilogue>
void tile_rows(const typename Kind::In* x, int64_t ldx, const typename Kind::In* p, int64_t M, int64_t K,
               int64_t nb0, int64_t halves, int64_t* configured, const Epilogue& epilogue) {
  constexpr int64_t D = Kind::kDepth, block = kN * D;
  constexpr int64_t row_bytes = D * sizeof(typename Kind::In);
  const int64_t KB = K / D;
  const typename Kind::In* p0 = p + nb0 * KB * block;
  const typename Kind::In* p1 = p0 + KB * block;
  const bool two = halves == 2;
  alignas(64) typename Kind::Acc c[4][16 * kN];
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, M - m0);
    const int r0 = static_cast<int>(std::min<int64_t>(16, rows)), r1 = static_cast<int>(rows - r0);
    if (*configured != rows) {
      configure(r0, r1);
      *configured = rows;
    }
    const typename Kind::In* x0 = x + m0 * ldx;
    const typename Kind::In* x1 = x0 + 16 * ldx;
    const int64_t stride = ldx * sizeof(typename Kind::In);
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      _tile_loadd(4, x0 + kb * D, stride);
      _tile_loadd(6, p0 + kb * block, row_bytes);
      SHOAL_TILE_PRODUCT(Kind, 0, 4, 6);
      if (two) {
        _tile_loadd(7, p1 + kb * block, row_bytes);
        SHOAL_TILE_PRODUCT(Kind, 1, 4, 7);
      }
      if (r1) {
        _tile_loadd(5, x1 + kb * D, stride);
        SHOAL_TILE_PRODUCT(Kind, 2, 5, 6);
        if (two) SHOAL_TILE_PRODUCT(Kind, 3, 5, 7);
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
      for (int64_t b = 0; b < halves; ++b) epilogue(c[2 * a + b] + (r % 16) * kN, m0 + r, (nb0 + b) * kN);
    }
  }
}

// The vector path for one activation row: each weight block row (16 outputs x one input pair) times the broadcast
// pair. Four accumulators, so that consecutive vdpbf16ps do not wait on each other (with one, the stream is bound by
// the instruction's latency).
template <typename Y>
void vec_row(const c10::BFloat16* x, const c10::BFloat16* p, const c10::BFloat16* bias, Y* y, int64_t K,
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

template <typename Y>
void vec_linear(const c10::BFloat16* x, const c10::BFloat16* p, const c10::BFloat16* bias, Y* y,
                int64_t N, int64_t K) {
  const int64_t NB = N / kN;
  // Dynamic: a thread that starts late (woken from a passive wait, or descheduled) takes fewer blocks.
#pragma omp parallel for schedule(dynamic, 4) if (N * K >= kParallelMin && omp_get_max_threads() > 1)
  for (int64_t nb = 0; nb < NB; ++nb) vec_row(x, p, bias, y, K, nb);
}

// y rows [0, M) over every output block, work split over the OpenMP threads (see tile_rows for the epilogue).
// prologue() runs first inside the same parallel region (the int8 path quantizes x there: an orphaned `omp for`,
// whose barrier ends before any tile product starts), saving a second fork/join per layer.
struct NoPrologue {
  void operator()() const {}
};

template <class Kind, class Epilogue, class Prologue = NoPrologue>
void amx_linear(const typename Kind::In* x, int64_t ldx, const typename Kind::In* p, int64_t M, int64_t N, int64_t K,
                const Epilogue& epilogue, const Prologue& prologue = {}) {
  const int64_t NB = N / kN, pairs = (NB + 1) / 2;  // two output blocks per tile pass (the last may have one)
  // Beyond one pass of rows, a task takes a panel of output pairs whose weights (~128 KiB) stay in L2 while every
  // 32-row chunk of x passes over them; otherwise each pair would re-read all of x.
  const int threads = omp_get_max_threads();
  int64_t panel = 1;
  if (M > 32)
    panel = std::max<int64_t>(1, std::min<int64_t>(128 / (K / Kind::kDepth) + 1, pairs / (4 * threads)));
  const int64_t tasks = (pairs + panel - 1) / panel;
#pragma omp parallel if (N * K >= kParallelMin && threads > 1)
  {
    prologue();
    int64_t configured = -1;  // tile configs are per thread, and another library may have loaded its own
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t first = t * panel, last = std::min(pairs, first + panel);
      for (int64_t m0 = 0; m0 < M; m0 += 32)
        for (int64_t pr = first; pr < last; ++pr) {
          auto shifted = [&](const typename Kind::Acc* c, int64_t row, int64_t n) { epilogue(c, m0 + row, n); };
          tile_rows<Kind>(x + m0 * ldx, ldx, p, std::min<int64_t>(32, M - m0), K, 2 * pr,
                          std::min<int64_t>(2, NB - 2 * pr), &configured, shifted);
        }
    }
    if (configured >= 0) _tile_release();
  }
}

// Per-row symmetric int8 quantization of x [M, K] as quantization/int8.py's quantize_rows_int8 does it (scale =
// max(max|x|, 1e-8) / 127, q = round(x / scale), ties to even, clamped to +-127).
// 16 activations widened to float32.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) { return shoal_amx::load_bf16(x); }

// Called inside a parallel region (its rows are shared among the threads) or outside one. K % 64 == 0.
template <typename T>
void quantize_rows_s8(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scales) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < M; ++r) {
    const T* xr = x + r * ldx;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(xr + i)));
    const float scale = std::max(_mm512_reduce_max_ps(amax), 1e-8f) / 127.0f;
    scales[r] = scale;
    const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    int8_t* qr = q + r * K;
    for (int64_t i = 0; i < K; i += 16) {  // x / scale (a true division, as torch's), nearest even, clamped
      const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(xr + i), s), _MM_FROUND_TO_NEAREST_INT |
                                                                              _MM_FROUND_NO_EXC);
      _mm_storeu_si128((__m128i*)(qr + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi))));
    }
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

// y [M, N] = x [M, K] @ w^T + bias, w given as its pair layout `packed` [N/16, K/32, 16, 32] (see the top); bfloat16,
// or with float_out the same bfloat16 values as float32 (an LM head's logits).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  bool float_out) {
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
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#ifdef SHOAL_AMX
  if (M == 0) return y;
  using B = c10::BFloat16;
  const B* xp = static_cast<const B*>(x.data_ptr());
  const B* pp = static_cast<const B*>(packed.data_ptr());
  const B* bp = bias.has_value() ? static_cast<const B*>(bias->data_ptr()) : nullptr;
  auto run = [&](auto* yp) {
    if (M >= kAmxMinRows) {
      amx_linear<Bf16Tiles>(xp, x.stride(0), pp, M, N, K, [&](const float* c, int64_t row, int64_t n) {
        store16(c, bp ? bp + n : nullptr, yp + row * N + n);
      });
    } else {
      vec_linear(xp, pp, bp, yp, N, K);  // M == 1
    }
  };
  if (float_out) run(static_cast<float*>(y.data_ptr()));
  else run(static_cast<B*>(y.data_ptr()));
#endif
  return y;
}

// int8 W8A8: y [M, N] = (x quantized per row) @ q^T, scaled back by each row's and each output's scale (+ bias),
// in x's dtype (float32 or bfloat16). q: the int8 weight in the tiles' quad layout [N/16, K/64, 16, 64]
// (p[kq][n][j] = q[16 nb + n][64 kb + 4 kq + j]), w_scale float32 [N], bias in x's dtype. The integer products are
// exact (int32 sums), as oneDNN's VNNI GEMM's are; the scaling is float32: (acc * w_scale) * x_scale.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "shoal_cpu_amx.int8_linear: AMX tiles are not available in this process");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "expected float32 or bfloat16 x [M, K] with a contiguous feature axis");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kN && packed.size(3) == 64,
              "expected the packed int8 weight [N/16, K/64, 16, 64]");
  const int64_t M = x.size(0), N = packed.size(0) * kN, K = packed.size(1) * 64;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.size(0) == N && w_scale.is_contiguous() &&
                  w_scale.scalar_type() == at::kFloat,
              "w_scale must be contiguous float32 [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "bias must be contiguous [N] in x's dtype");
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef SHOAL_AMX
  if (M == 0) return y;
  // A last pass of fewer than 16 rows loads only its own rows (tile rows are configured per pass). Kept between
  // calls (trim_scratch).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  xq.resize(size_t(M) * K), xs.resize(M);
  const int8_t* qp = static_cast<const int8_t*>(packed.data_ptr());
  const float* ws = w_scale.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    int8_t* xqp = xq.data();
    float* xsp_w = xs.data();
    auto quantize = [&] { quantize_rows_s8(xp, x.stride(0), M, K, xqp, xsp_w); };
    const T* bp = bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr;
    T* yp = static_cast<T*>(y.data_ptr());
    const float* xsp = xs.data();
    amx_linear<Int8Tiles>(xq.data(), K, qp, M, N, K, [&](const int32_t* c, int64_t row, int64_t n) {
      const __m512 acc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c)), _mm512_loadu_ps(ws + n));
      __m512 v = _mm512_mul_ps(acc, _mm512_set1_ps(xsp[row]));
      if constexpr (std::is_same_v<T, float>) {
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + n));
        _mm512_storeu_ps(yp + row * N + n, v);
      } else {
        if (bp) v = _mm512_add_ps(v, shoal_amx::load_bf16(bp + n));
        _mm256_storeu_si256((__m256i*)(yp + row * N + n), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }, quantize);
  };
  if (dtype == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  shoal_amx::trim_scratch(xq), shoal_amx::trim_scratch(xs);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_amx, m) {
  m.def("available() -> bool", &available);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_amx, CPU, m) {
  m.impl("linear", &linear);
  m.impl("int8_linear", &int8_linear);
}
