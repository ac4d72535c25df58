// Small-M linear layer on CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 or bfloat16, for the few rows of a
// low-batch decode step.
//
// At M = 1..16 a linear layer is a stream over its weight: every weight byte is read once and used M times, so the
// step's speed is the memory bandwidth the kernel sustains. The BLAS/oneDNN paths torch takes are built for large M
// (measured here: a prepacked bfloat16 oneDNN GEMM reads a SmolLM2-sized model at about half the bandwidth a plain
// stream gets). This kernel walks the weight row-block by row-block (split between the OpenMP threads), keeps the M
// activation rows in float32 in L1, and accumulates R weight rows x MB activation rows of dot products in registers,
// converting bfloat16 weights to float32 in registers (the conversion is exact; products and sums are float32, as
// in oneDNN's bfloat16 GEMM). A weight block stays in L2 while every chunk of MB activation rows passes over it.
//
// Paths: AVX-512F (16 lanes, masked tails), AVX2+FMA (8 lanes), and a portable loop (`omp simd` reductions: SSE2
// on generic x86, NEON on ARM64) for everything else. Registered as torch.ops.shoal_cpu_gemm.linear; built by
// layers/small_gemm.py for this process's CPU tier (execution/native_build.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxMB = 4;              // activation rows per micro-kernel pass
// Weight rows per parallel task (a multiple of every R below). Each thread's task is one stretch of the weight the
// hardware prefetchers can follow: on an Intel Xeon (2 threads, SmolLM2's 30 float32 layers streamed from DRAM at
// batch 1) 16-row tasks reached 21 GB/s, 64-row tasks 23-26 GB/s, as MKL's sgemv does; 128 measured no better.
constexpr int64_t kBlockRows = 64;
constexpr int64_t kParallelMin = 1 << 16;  // weight elements below which one thread is faster than a fork/join
// Software prefetch of the weight rows one pass ahead. A single core's streaming bandwidth is bounded by the loads
// it has in flight, and the hardware prefetchers alone left it at 8.5 GB/s for bfloat16 weights where prefetching
// 4 rows ahead reaches 12 (one core, SmolLM2's layer shapes); 8 or 16 rows ahead measured no better.
constexpr int64_t kPrefetchRows = 4;

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float load_scalar(const T* p) { return static_cast<float>(*p); }
template <>
inline float load_scalar<c10::BFloat16>(const c10::BFloat16* p) { return bf16_to_float(p->x); }

template <typename T>
inline T store_scalar(float v) { return static_cast<T>(v); }  // c10::BFloat16: round to nearest even

// ------------------------------------------------------------------------------------------------ AVX-512F
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vload_tail(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline Vec vload_tail(const c10::BFloat16* p, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
// The four sums of a, b, c, d at once (a transpose-and-add: a third of the instructions of four reductions).
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  // Each 128-bit lane now holds that lane's partial sums [a, b, c, d]: add the four lanes.
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#define SHOAL_SIMD 1

// -------------------------------------------------------------------------------------------------- AVX2
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename T>
inline Vec vload_tail(const T* p, int64_t n) {  // no masked 16-bit loads in AVX2: through a zeroed buffer
  alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) buf[i] = load_scalar(p + i);
  return _mm256_load_ps(buf);
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {  // the four sums of a, b, c, d at once
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#define SHOAL_SIMD 1
#endif

#ifdef SHOAL_SIMD
// Weight rows per micro-kernel pass: AVX-512's 32 vector registers hold 4 x 4 accumulators; AVX2's 16 hold 4 x 2
// (and 4 x 1..2, enough independent FMA chains at M = 1).
constexpr int64_t rows_for(int64_t MB) { return kLanes == 16 || MB <= 2 ? 4 : 2; }

template <int64_t MB, int64_t R>
inline void reduce_rows(const Vec (&acc)[MB][R], float out[kMaxMB][4]) {
  for (int64_t m = 0; m < MB; ++m) {
    if constexpr (R == 4) {
      _mm_storeu_ps(out[m], vsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else {
      for (int64_t r = 0; r < R; ++r) out[m][r] = vsum(acc[m][r]);
    }
  }
}

// out[m][r] = sum_k xf[m][k] * w[r][k] for MB activation rows (float32, row stride K) and R weight rows.
template <int64_t MB, int64_t R, typename T>
inline void micro(const float* xf, int64_t K, const T* w, int64_t ldw, float out[kMaxMB][4]) {
  Vec acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[R];
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(w + (r + kPrefetchRows) * ldw + k, 0, 3);  // never faults, even past the end
      wv[r] = vload(w + r * ldw + k);
    }
    for (int64_t m = 0; m < MB; ++m) {
      const Vec xv = vload(xf + m * K + k);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    Vec wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = vload_tail(w + r * ldw + k, n);
    for (int64_t m = 0; m < MB; ++m) {
      const Vec xv = vload_tail(xf + m * K + k, n);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
    }
  }
  reduce_rows<MB, R>(acc, out);
}

#if defined(__AVX512BF16__)
// Native bfloat16 (AVX512-BF16): bfloat16 activations against bfloat16 weights with vdpbf16ps, 32 products per
// instruction (each exact in float32, pairs summed in float32): twice the arithmetic of converting to float32,
// which decides the speed from M = 8 on.
#define SHOAL_DPBF16 1
inline __m512bh bh_load(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bh_load_tail(const c10::BFloat16* p, int64_t n) {
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}

template <int64_t MB, int64_t R>
inline void micro(const c10::BFloat16* xb, int64_t K, const c10::BFloat16* w, int64_t ldw, float out[kMaxMB][4]) {
  __m512 acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(w + (r + kPrefetchRows) * ldw + k, 0, 3);
      wv[r] = bh_load(w + r * ldw + k);
    }
    for (int64_t m = 0; m < MB; ++m) {
      const __m512bh xv = bh_load(xb + m * K + k);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (k < K) {  // masked-off lanes load as +0.0, adding nothing
    const int64_t n = K - k;
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = bh_load_tail(w + r * ldw + k, n);
    for (int64_t m = 0; m < MB; ++m) {
      const __m512bh xv = bh_load_tail(xb + m * K + k, n);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  reduce_rows<MB, R>(acc, out);
}
#endif
#else
constexpr int64_t rows_for(int64_t) { return 4; }

template <int64_t MB, int64_t R, typename T>
inline void micro(const float* xf, int64_t K, const T* w, int64_t ldw, float out[kMaxMB][4]) {
  for (int64_t m = 0; m < MB; ++m) {
    const float* xm = xf + m * K;
    for (int64_t r = 0; r < R; ++r) {
      const T* wr = w + r * ldw;
      for (int64_t k = 0; k < K; k += 64 / sizeof(T)) __builtin_prefetch(wr + kPrefetchRows * ldw + k, 0, 3);
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xm[k] * load_scalar(wr + k);
      out[m][r] = acc;
    }
  }
}
#endif

// The MB activation rows starting at m0 against weight rows [n0, n0 + rows): rows in groups of R, then singly.
template <int64_t MB, typename T, typename A>
inline void rows_pass(const A* xa, int64_t K, const T* w, const T* bias, T* y, int64_t ldy, int64_t m0,
                      int64_t n0, int64_t rows) {
  constexpr int64_t R = rows_for(MB);
  float out[kMaxMB][4];
  int64_t n = n0;
  for (; n + R <= n0 + rows; n += R) {
    micro<MB, R>(xa + m0 * K, K, w + n * K, K, out);
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t r = 0; r < R; ++r)
        y[(m0 + m) * ldy + n + r] = store_scalar<T>(out[m][r] + (bias ? load_scalar(bias + n + r) : 0.0f));
  }
  for (; n < n0 + rows; ++n) {
    micro<MB, 1>(xa + m0 * K, K, w + n * K, K, out);
    for (int64_t m = 0; m < MB; ++m)
      y[(m0 + m) * ldy + n] = store_scalar<T>(out[m][0] + (bias ? load_scalar(bias + n) : 0.0f));
  }
}

// Every row block of the weight against every chunk of kMaxMB activation rows; xa: the activations as the micro
// kernel reads them (A = float32, or bfloat16 for vdpbf16ps), contiguous [M, K].
template <typename T, typename A>
void blocks(const A* xa, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = (N + kBlockRows - 1) / kBlockRows;
  // Dynamic: a thread that starts late (woken from a passive wait, or descheduled on a shared machine) takes
  // fewer blocks instead of holding up the others at the region's end.
#pragma omp parallel for schedule(dynamic, 1) if (N * K >= kParallelMin && omp_get_max_threads() > 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, N - n0);
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) rows_pass<4>(xa, K, w, bias, y, N, m0, n0, rows);
    switch (M - m0) {
      case 3: rows_pass<3>(xa, K, w, bias, y, N, m0, n0, rows); break;
      case 2: rows_pass<2>(xa, K, w, bias, y, N, m0, n0, rows); break;
      case 1: rows_pass<1>(xa, K, w, bias, y, N, m0, n0, rows); break;
      default: break;
    }
  }
}

template <typename T>
void linear_impl(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#ifdef SHOAL_DPBF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    std::vector<T> xc;
    if (ldx != K) {
      xc.resize(M * K);
      for (int64_t m = 0; m < M; ++m) std::memcpy(xc.data() + m * K, x + m * ldx, K * sizeof(T));
      x = xc.data();
    }
    blocks<T, T>(x, w, bias, y, M, N, K);
    return;
  }
#endif
  // The activations in float32, contiguous: converted once (float32 rows already contiguous are used as they
  // are), then read from L1 for every weight row.
  std::vector<float> xf;
  const float* xp = reinterpret_cast<const float*>(x);
  if (!std::is_same_v<T, float> || ldx != K) {
    xf.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = load_scalar(x + m * ldx + k);
    xp = xf.data();
  }
  blocks<T, float>(xp, w, bias, y, M, N, K);
}

// y [M, N] = x [M, K] @ w [N, K]^T + bias [N]; x may have strided rows, w and bias are contiguous, all one dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected x [M, K] with a contiguous feature axis");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "expected a contiguous w [N, K]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(w.scalar_type() == dtype, "x and w dtypes differ");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "bias must be contiguous [N] in x's dtype");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (dtype == at::kFloat) {
    linear_impl<float>(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(),
                       bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K);
  } else if (dtype == at::kBFloat16) {
    using B = c10::BFloat16;
    linear_impl<B>(static_cast<const B*>(x.data_ptr()), x.stride(0), static_cast<const B*>(w.data_ptr()),
                   bias.has_value() ? static_cast<const B*>(bias->data_ptr()) : nullptr,
                   static_cast<B*>(y.data_ptr()), M, N, K);
  } else {
    TORCH_CHECK(false, "shoal_cpu_gemm.linear supports float32 and bfloat16, got ", dtype);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_gemm, m) { m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(shoal_cpu_gemm, CPU, m) { m.impl("linear", &linear); }
