// Fused CPU kernels for a decoder layer's small elementwise steps: residual add + RMSNorm, SwiGLU (SiLU(gate) *
// up), RoPE applied in place to the queries and keys of a fused QKV projection, and the int8 W8A8 linear layer
// (per-token activation quantization and the dequantizing epilogue around oneDNN's int8 GEMM).
//
// In a decode step each of these touches only batch x hidden values; the time goes to launching the 3-9 separate
// torch ops each one is made of, and to their temporaries. One call each, no temporaries. Every kernel keeps the
// reference's rounding steps (see layers/fused.py): in bfloat16/float16 each intermediate the torch reference
// rounds is rounded here too, so the results match it to the last bit except for the order of a float32 sum.
//
// Registered with the dispatcher (TORCH_LIBRARY) as torch.ops.shoal_cpu_fused.*; built by layers/fused.py with
// torch.utils.cpp_extension for the CPU tier at hand (execution/native_build.py).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_math.h"
#include "scalar_types.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

namespace {

constexpr int64_t kParallelMin = 1 << 15;  // elements below which OpenMP's fork/join costs more than it saves

using shoal::from_float;
using shoal::to_float;
// What the reference does to an intermediate: nothing in float32, a rounding to T otherwise.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

using shoal::exp_approx;  // fast_math.h

template <typename F>
void for_rows(int64_t rows, int64_t work, F&& body) {
#pragma omp parallel for schedule(static) if (work >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) body(r);
}

// ------------------------------------------------------------------------------------------ residual + RMSNorm

template <typename T>
void add_rms_norm_impl(T* out, T* residual, const T* delta, const T* weight, int64_t rows, int64_t hidden,
                       int64_t s_out, int64_t s_res, int64_t s_delta, float eps, bool unit_offset) {
  for_rows(rows, rows * hidden, [&](int64_t r) {
    T* res = residual + r * s_res;
    T* o = out + r * s_out;
    float sumsq = 0.0f;
    if (delta != nullptr) {
      const T* d = delta + r * s_delta;
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = round_to<T>(to_float(res[i]) + to_float(d[i]));  // the residual stream is stored in T
        res[i] = from_float<T>(v);
        sumsq += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = to_float(res[i]);
        sumsq += v * v;
      }
    }
    const float inv = 1.0f / std::sqrt(sumsq / float(hidden) + eps);
    if (unit_offset) {  // Gemma's norm: scaled by (1 + w) in float32, rounded once
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_float<T>(to_float(res[i]) * inv * (1.0f + to_float(weight[i])));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        // Reference (reduced precision): normalise in float32, round to T, then scale by the weight in T.
        o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(res[i]) * inv));
      }
    }
  });
}

// out = rms_norm(residual + delta) * weight, with residual += delta stored in place; delta may be absent (then
// out = rms_norm(residual) * weight and residual is left alone). unit_offset: Gemma's norm, * (1 + weight).
void add_rms_norm(const at::Tensor& out, const at::Tensor& residual, const std::optional<at::Tensor>& delta,
                  const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(residual.dim() == 2 && out.sizes() == residual.sizes(), "expected out and residual [T, hidden]");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(out.stride(1) == 1 && residual.stride(1) == 1, "the hidden axis must be contiguous");
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && weight.scalar_type() == dtype, "out, residual and weight dtypes differ");
  int64_t s_delta = 0;
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->stride(1) == 1 && delta->scalar_type() == dtype,
                "delta must match residual");
    s_delta = delta->stride(0);
  }
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_impl<T>(static_cast<T*>(out.data_ptr()), static_cast<T*>(residual.data_ptr()),
                         delta.has_value() ? static_cast<const T*>(delta->data_ptr()) : nullptr,
                         static_cast<const T*>(weight.data_ptr()), rows, hidden, out.stride(0), residual.stride(0),
                         s_delta, float(eps), unit_offset);
  };
  if (dtype == at::kFloat) launch(float{});
  else if (dtype == at::kBFloat16) launch(c10::BFloat16{});
  else if (dtype == at::kHalf) launch(c10::Half{});
  else TORCH_CHECK(false, "add_rms_norm supports float32/bfloat16/float16, got ", dtype);
}

// --------------------------------------------------------------------------------------- SwiGLU and GeGLU

// The activations of the gated MLPs, on the gate's value in float32, each rounded to T as the reference's own op
// rounds its result (F.silu, F.gelu(approximate="tanh")) before the product with up.
struct Silu {
  static float act(float x) { return x / (1.0f + exp_approx(-x)); }
};
struct GeluTanh {
  // 0.5 x (1 + tanh z) as the reference writes it, tanh z = 1 - 2 / (e^2z + 1): x / (1 + e^-2z) would be more
  // accurate where tanh z is near -1, but the reference's own cancellation there is what the model was run with
  // (-100 gives 0, not -6e-37).
  static float act(float x) {
    const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + (1.0f - 2.0f / (exp_approx(2.0f * z) + 1.0f)));
  }
};

template <typename T, class Act>
void gated_rows(T* out, const T* in, int64_t rows, int64_t inter, int64_t s_out, int64_t s_in) {
  for_rows(rows, rows * inter, [&](int64_t r) {
    const T* g = in + r * s_in;
    const T* u = g + inter;
    T* o = out + r * s_out;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) o[i] = from_float<T>(round_to<T>(Act::act(to_float(g[i]))) * to_float(u[i]));
  });
}

// out [T, I] = act(in[:, :I]) * in[:, I:] for in [T, 2I] (gate and up side by side, as a merged projection).
template <class Act>
void gated(const at::Tensor& out, const at::Tensor& in, const char* name) {
  TORCH_CHECK(in.dim() == 2 && in.size(1) % 2 == 0, "expected in [T, 2 * intermediate]");
  const int64_t rows = in.size(0), inter = in.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == inter, "expected out [T, intermediate]");
  TORCH_CHECK(in.stride(1) == 1 && out.stride(1) == 1, "the feature axis must be contiguous");
  const auto dtype = in.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype, "in and out dtypes differ");
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    gated_rows<T, Act>(static_cast<T*>(out.data_ptr()), static_cast<const T*>(in.data_ptr()), rows, inter,
                       out.stride(0), in.stride(0));
  };
  if (dtype == at::kFloat) launch(float{});
  else if (dtype == at::kBFloat16) launch(c10::BFloat16{});
  else if (dtype == at::kHalf) launch(c10::Half{});
  else TORCH_CHECK(false, name, " supports float32/bfloat16/float16, got ", dtype);
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& in) { gated<Silu>(out, in, "silu_and_mul"); }
void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& in) { gated<GeluTanh>(out, in, "gelu_tanh_and_mul"); }

// ------------------------------------------------------------------------------------------------------- RoPE

template <typename T>
void rotary_impl(T* x, const int64_t* positions, const T* cos, const T* sin, int64_t rows, int64_t heads,
                 int64_t D, int64_t s_row, int64_t max_pos) {
  const int64_t half = D / 2;
  for_rows(rows, rows * heads * D, [&](int64_t r) {
    const int64_t pos = positions[r];  // checked by the caller (no exception may leave an OpenMP region)
    const T* c = cos + pos * D;
    const T* s = sin + pos * D;
    float buf[512];
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * s_row + h * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) buf[i] = to_float(v[i]);
      // x * cos + roll(x, half) * sin, sin holding [-sin, sin]: each product and the sum rounded as in T.
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        const float rolled = buf[i < half ? i + half : i - half];
        const float a = round_to<T>(buf[i] * to_float(c[i]));
        const float b = round_to<T>(rolled * to_float(s[i]));
        v[i] = from_float<T>(a + b);
      }
    }
  });
}

// Rotates, in place, the first `heads` heads of every row of x [T, >= heads * D] (queries then keys of a fused QKV
// projection) by the table rows of each token's position: cos [P, D] = [cos, cos], sin [P, D] = [-sin, sin].
void rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * head_dim, "expected x [T, >= heads * D]");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "head_dim must be even and at most 512");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong &&
              positions.is_contiguous(), "positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
              sin.is_contiguous(), "cos/sin must be contiguous [max_positions, head_dim]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "x and the tables' dtypes differ");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is outside the rotary table (",
                cos.size(0), " positions)");
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(static_cast<T*>(x.data_ptr()), positions.data_ptr<int64_t>(), static_cast<const T*>(cos.data_ptr()),
                   static_cast<const T*>(sin.data_ptr()), x.size(0), heads, head_dim, x.stride(0), cos.size(0));
  };
  if (dtype == at::kFloat) launch(float{});
  else if (dtype == at::kBFloat16) launch(c10::BFloat16{});
  else if (dtype == at::kHalf) launch(c10::Half{});
  else TORCH_CHECK(false, "rotary_embedding supports float32/bfloat16/float16, got ", dtype);
}

// -------------------------------------------------------------------------------------------- int8 W8A8 linear

// Per-row symmetric int8 quantization of x [M, K] (as quantization/int8.py's quantize_rows_int8: scale =
// max|x| / 127, q = round(x / scale), ties to even), stored offset by +128 as uint8: oneDNN's fast int8 GEMM
// (VNNI multiplies unsigned x signed bytes) wants unsigned activations, and zero point 128 makes them exact.
template <typename T>
void quantize_rows_u8(uint8_t* q, float* scales, const T* x, int64_t rows, int64_t K, int64_t s_x) {
  for_rows(rows, rows * K, [&](int64_t r) {
    const T* xr = x + r * s_x;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < K; ++i) amax = std::max(amax, std::fabs(to_float(xr[i])));
    const float scale = std::max(amax, 1e-8f) / 127.0f;
    scales[r] = scale;
    uint8_t* qr = q + r * K;
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) {
      const float v = std::nearbyint(to_float(xr[i]) / scale);
      qr[i] = static_cast<uint8_t>(static_cast<int32_t>(std::min(std::max(v, -127.0f), 127.0f)) + 128);
    }
  });
}

// The exact C++ signature onednn::qlinear_pointwise was registered with (the dispatcher checks it).
using QLinearFn = at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                             double, int64_t, std::optional<c10::ScalarType>, c10::string_view,
                             c10::List<std::optional<c10::Scalar>>, c10::string_view);

// y = x @ W^T for W quantized per output channel (int8, prepacked by torch.ops.onednn.qlinear_prepack, scales
// w_scale [N] float32): x is quantized per token, oneDNN's int8 GEMM gives acc * w_scale in float32, and one pass
// multiplies by the token's scale, adds the bias and rounds to x's dtype. One call from Python per layer instead
// of the ~12 torch ops the same arithmetic takes there.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                       const at::Tensor& w_zero_point, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected x [M, K] with a contiguous feature axis");
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.size(0);
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "w_scale must be contiguous float32 [N]");
  const auto dtype = x.scalar_type();
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "bias must be contiguous [N] in x's dtype");
  static const auto qlinear = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("onednn::qlinear_pointwise", "")
                                  .typed<QLinearFn>();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({M, N}, x.options());
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    quantize_rows_u8<T>(xq.data_ptr<uint8_t>(), xs.data_ptr<float>(), static_cast<const T*>(x.data_ptr()), M, K,
                        x.stride(0));
    const at::Tensor acc = qlinear.call(xq, 1.0, 128, w_packed, w_scale, w_zero_point, std::nullopt, 1.0, 0,
                                        at::kFloat, "none", c10::List<std::optional<c10::Scalar>>(), "");
    TORCH_CHECK(acc.is_contiguous() && acc.size(0) == M && acc.size(1) == N, "unexpected int8 GEMM output");
    const float* a = acc.data_ptr<float>();
    const float* xsp = xs.data_ptr<float>();
    const T* b = bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr;
    T* o = static_cast<T*>(out.data_ptr());
    for_rows(M, M * N, [&](int64_t r) {
      const float* ar = a + r * N;
      T* orow = o + r * N;
      const float s = xsp[r];
      if (b == nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) orow[j] = from_float<T>(ar[j] * s);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) orow[j] = from_float<T>(ar[j] * s + to_float(b[j]));
      }
    });
  };
  if (dtype == at::kFloat) launch(float{});
  else if (dtype == at::kBFloat16) launch(c10::BFloat16{});
  else if (dtype == at::kHalf) launch(c10::Half{});
  else TORCH_CHECK(false, "int8_linear supports float32/bfloat16/float16 activations, got ", dtype);
  return out;
}

// ------------------------------------------------------------------------------------------- greedy argmax

// Index of the first maximum of each row of x [B, V] (float32), as torch.max(dim=-1).indices: a NaN counts as the
// maximum (its first occurrence wins). torch's CPU max/argmax over a row is a scalar loop that kept every value's
// index (~0.8 ms for 32 x 32000 here); a vectorised max, then a scan for its first occurrence, takes ~30 us.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "argmax_rows expects float32 [B, V] with contiguous rows");
  const int64_t B = x.size(0), V = x.size(1), sx = x.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows needs at least one column");
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for_rows(B, B * V, [&](int64_t r) {
    const float* row = xp + r * sx;
    // 16 independent lanes (the compiler keeps them in one vector register), folded at the end: a single running
    // max would be a dependency chain that does not vectorise.
    float lane_max[16];
    int32_t lane_nan[16];
    for (int k = 0; k < 16; ++k) lane_max[k] = -std::numeric_limits<float>::infinity(), lane_nan[k] = 0;
    int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
#pragma omp simd
      for (int k = 0; k < 16; ++k) {
        const float v = row[j + k];
        lane_max[k] = v > lane_max[k] ? v : lane_max[k];
        lane_nan[k] |= v != v;
      }
    }
    float mx = lane_max[0];
    int nan = 0;
    for (int k = 0; k < 16; ++k) mx = std::max(mx, lane_max[k]), nan |= lane_nan[k];
    for (; j < V; ++j) mx = std::max(mx, row[j]), nan |= row[j] != row[j];
    int64_t idx = 0;
    if (nan) {
      while (row[idx] == row[idx]) ++idx;
    } else {
      while (row[idx] != mx) ++idx;  // mx is one of the row's values, so this stops
    }
    o[r] = idx;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_fused, m) {
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor? delta, Tensor weight, float eps, "
        "bool unit_offset=False) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_zero_point, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_fused, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("int8_linear", &int8_linear);
  m.impl("argmax_rows", &argmax_rows);
}

// The prepacked int8 weight is an MKLDNN tensor, which makes the dispatcher pick this key for int8_linear.
TORCH_LIBRARY_IMPL(shoal_cpu_fused, MkldnnCPU, m) { m.impl("int8_linear", &int8_linear); }
