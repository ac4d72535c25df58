// torch.ops.shoal_cpu_gguf: matmul against GGUF-quantized weights kept in their block format (csrc/gguf_matmul.h),
// their dequantization, and an embedding lookup that dequantizes only the rows it reads.

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "gguf_matmul.h"

namespace {

using namespace shoal_gguf;

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = format_of(static_cast<int>(qtype));
  TORCH_CHECK(f.block, "gguf kernel: unsupported GGML type id ", qtype,
              " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "gguf kernel: a packed weight must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(K % f.block == 0, "gguf kernel: K=", K, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "gguf kernel: rows of ", w.size(1), " bytes, but K=", K,
              " needs ", K / f.block * f.bytes);
}

// float32 view of a tensor's values: the tensor itself when it is float32 and contiguous, else a copy in `buf`.
const float* as_float(const torch::Tensor& t, std::vector<float>& buf) {
  if (t.scalar_type() == torch::kFloat32 && t.is_contiguous()) return t.data_ptr<float>();
  buf.resize(t.numel());
  torch::from_blob(buf.data(), t.sizes(), torch::kFloat32).copy_(t);
  return buf.data();
}

// y [M, N] = x [M, K] @ [weights...]^T + bias, in x's dtype (float32, bfloat16 or float16).
torch::Tensor gguf_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                          const std::vector<int64_t>& qtypes, int64_t K, int64_t N,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "gguf kernel: one qtype per weight segment");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, "gguf kernel: x must be a CPU tensor [M, ", K,
              "]");
  const auto dtype = x.scalar_type();
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
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N), "gguf kernel: bias must be [", N, "]");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  thread_local std::vector<float> xbuf, bbuf;
  const float* xf = as_float(x, xbuf);
  const float* bf = has_bias ? as_float(*bias, bbuf) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gguf_matmul", [&] {
    packed_matmul(xf, M, K, segs, N, bf, y.data_ptr<scalar_t>());
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
