// Matmul against GGUF-quantized weights kept in their block format: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W one
// or more row segments (a fused QKV or gate/up projection is several GGUF tensors, maybe of different types), each
// [rows, K / block * bytes] uint8 as stored in the file; rows past the segments (a vocabulary-parallel head's
// padding) are zero weights. The dot products are csrc/gguf_kernels.h, built for this process's CPU tier.
//
// Decode-sized batches (M <= kSmallBatch) make one pass over the packed weight, the rows split across threads:
// each 32-weight group is unpacked in registers once for up to four activation rows, so the weight streams from
// memory once per four rows, and the activations (float32, group sums computed once) stay in L1. Larger batches
// (prefill) dequantize a tile of rows at a time into float32 and use torch's GEMM, which is compute-bound there.
// Scratch buffers are thread-local and reused: a decode step allocates only its output tensor.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_kernels.h"

namespace {

using namespace shoal_gguf;

constexpr int64_t kSmallBatch = 16;  // above this, dequantize tiles and use torch's GEMM
constexpr int64_t kTileRows = 256;
constexpr int64_t kChunkRows = 64;           // rows a thread computes before storing them
constexpr int64_t kMinBytesPerThread = 1 << 15;  // below this a thread's fork/join costs more than its rows

Format checked_format(int64_t qtype) {
  const Format f = format_of(static_cast<int>(qtype));
  TORCH_CHECK(f.block, "gguf kernel: unsupported GGML type id ", qtype,
              " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
  return f;
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = checked_format(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "gguf kernel: a packed weight must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(K % f.block == 0, "gguf kernel: K=", K, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "gguf kernel: rows of ", w.size(1), " bytes, but K=", K,
              " needs ", K / f.block * f.bytes);
}

void dequantize_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, float* out,
                     const int64_t* ids = nullptr) {
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block;
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinBytesPerThread / row_bytes), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + (ids ? ids[r] : r) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) dequantize_block(qtype, row + b * f.bytes, out + r * K + b * f.block);
    }
  });
}

// One row segment of the weight as the kernels see it.
struct Segment {
  const uint8_t* data;
  int64_t row_bytes, rows, first;  // first: its first row in the output
  int qtype;
};

// Stores rows [n0, n0 + n) of y from float results (acc [M, n]), adding the bias, in y's dtype.
template <typename T>
void store(const float* acc, int64_t M, int64_t n, int64_t n0, const float* bias, T* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; ++j) y[m * N + n0 + j] = static_cast<T>(acc[m * n + j] + (bias ? bias[n0 + j] : 0.0f));
}

// The decode path: rows [r0, r1) of the concatenated segments, kChunkRows at a time.
template <typename T>
void decode_rows(const std::vector<Segment>& segs, int64_t r0, int64_t r1, const QRows& a, int64_t M, int64_t K,
                 const float* bias, T* y, int64_t N) {
  float acc[kChunkRows * kSmallBatch];
  for (const Segment& s : segs) {
    const int64_t lo = std::max(r0, s.first), hi = std::min(r1, s.first + s.rows);
    for (int64_t n0 = lo; n0 < hi; n0 += kChunkRows) {
      const int64_t n = std::min(kChunkRows, hi - n0);
      dot_rows(s.qtype, s.data, s.row_bytes, n0 - s.first, n0 - s.first + n, a, M, K, acc, n);
      store(acc, M, n, n0, bias, y, N);
    }
  }
}

// Rows past the segments (zero weights): the bias alone.
template <typename T>
void fill_padding(T* y, int64_t M, int64_t N, int64_t rows, const float* bias) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = rows; n < N; ++n) y[m * N + n] = static_cast<T>(bias ? bias[n] : 0.0f);
}

// y [M, N] = x [M, K] @ [weights...]^T + bias, in x's dtype (float32, bfloat16 or float16).
torch::Tensor gguf_matmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                          const std::vector<int64_t>& qtypes, int64_t K, int64_t N,
                          const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "gguf kernel: one qtype per weight segment");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.size(1) == K,
              "gguf kernel: x must be a CPU tensor [M, ", K, "]");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "gguf kernel: x must be float32, bfloat16 or float16");
  std::vector<Segment> segs;
  int64_t rows = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], qtypes[i], K);
    segs.push_back({weights[i].data_ptr<uint8_t>(), weights[i].size(1), weights[i].size(0), rows,
                    static_cast<int>(qtypes[i])});
    rows += weights[i].size(0);
  }
  TORCH_CHECK(N >= rows, "gguf kernel: N=", N, " is less than the segments' ", rows, " rows");
  const int64_t M = x_in.size(0);
  auto y = torch::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;

  // Activations and bias as float32 (scratch reused across calls).
  thread_local std::vector<float> xbuf, dsbuf, bbuf;
  thread_local std::vector<int8_t> qbuf;
  const float* x;
  if (dtype == torch::kFloat32 && x_in.is_contiguous()) {
    x = x_in.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    at::Tensor view = torch::from_blob(xbuf.data(), {M, K}, torch::kFloat32);
    view.copy_(x_in);
    x = xbuf.data();
  }
  const float* bias = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == N, "gguf kernel: bias must be [", N, "]");
    bbuf.resize(N);
    torch::from_blob(bbuf.data(), {N}, torch::kFloat32).copy_(*bias_in);
    bias = bbuf.data();
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gguf_matmul", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    if (M <= kSmallBatch) {
      const int64_t ng = K / 32;
      qbuf.resize(M * K);
      dsbuf.resize(M * ng * 2);
      for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, &qbuf[m * K], &dsbuf[m * ng * 2]);
      const QRows a{qbuf.data(), dsbuf.data(), ng};
      const int64_t grain = std::max<int64_t>(4, kMinBytesPerThread / segs[0].row_bytes);
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { decode_rows(segs, r0, r1, a, M, K, bias, yp, N); });
    } else {  // prefill: dequantize kTileRows rows at a time, one GEMM each
      thread_local at::Tensor tile;
      if (!tile.defined() || tile.numel() < kTileRows * K) tile = torch::empty({kTileRows * K}, torch::kFloat32);
      const at::Tensor xf = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32);
      for (const Segment& s : segs)
        for (int64_t n0 = 0; n0 < s.rows; n0 += kTileRows) {
          const int64_t n = std::min(kTileRows, s.rows - n0);
          dequantize_rows(s.qtype, s.data + n0 * s.row_bytes, s.row_bytes, n, K, tile.data_ptr<float>());
          const at::Tensor part = at::mm(xf, tile.narrow(0, 0, n * K).view({n, K}).t());
          store(part.data_ptr<float>(), M, n, s.first + n0, bias, yp, N);
        }
    }
    if (N > rows) fill_padding(yp, M, N, rows, bias);
  });
  return y;
}

torch::Tensor gguf_dequantize(const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  auto out = torch::empty({w.size(0), K}, torch::kFloat32);
  dequantize_rows(static_cast<int>(qtype), w.data_ptr<uint8_t>(), w.size(1), w.size(0), K, out.data_ptr<float>());
  return out;
}

// float32 [ids.numel(), K]: rows `ids` of the packed table, dequantized (an embedding lookup).
torch::Tensor gguf_dequantize_rows(const torch::Tensor& w, const torch::Tensor& ids_in, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t n = ids.numel(), rows = w.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "gguf kernel: row id ", id[i], " outside the table's ", rows, " rows");
  auto out = torch::empty({n, K}, torch::kFloat32);
  dequantize_rows(static_cast<int>(qtype), w.data_ptr<uint8_t>(), w.size(1), n, K, out.data_ptr<float>(), id);
  return out;
}

std::string gguf_kernel_isa() {
  return std::string(kIsa) + " (Q8_0/Q4_0/Q4_1/Q4_K/Q6_K unpacked in registers; decode activations in 8-bit groups)";
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_gguf, m) {
  m.def("matmul(Tensor x, Tensor[] weights, int[] qtypes, int K, int N, Tensor? bias) -> Tensor", &gguf_matmul);
  m.def("dequantize(Tensor w, int qtype, int K) -> Tensor", &gguf_dequantize);
  m.def("dequantize_rows(Tensor w, Tensor ids, int qtype, int K) -> Tensor", &gguf_dequantize_rows);
  m.def("kernel_isa() -> str", &gguf_kernel_isa);
}
