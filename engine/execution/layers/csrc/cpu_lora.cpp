// Gathered low-rank (LoRA) update of a linear layer's output for a batch that mixes adapters:
//   y[t] += (x[t] @ A[s]^T) @ B[s]   for every token t whose adapter slot s = slots[t] >= 0 (-1: the base model).
// A: [S, R, in] (each slot's down-projection, zero-padded to R rows), B: [S, R, out] (the up-projection,
// transposed, already multiplied by the adapter's scale). Tokens are grouped by slot and each group runs as two
// GEMMs, so a prefill chunk costs two small matmuls per adapter, not one matrix-vector product per token. The loop
// runs over the S <= max_loras slots, never over tokens; slots without tokens cost one comparison pass.
// Registered as torch.ops.shoal_cpu_lora.lora_apply_ (in place on y).
#include <torch/library.h>
#include <ATen/ATen.h>

namespace {

void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_apply_: x [T, in], y [T, out]");
  TORCH_CHECK(A.dim() == 3 && B.dim() == 3 && A.size(0) == B.size(0) && A.size(1) == B.size(1),
              "lora_apply_: A [S, R, in], B [S, R, out]");
  TORCH_CHECK(A.size(2) == x.size(1) && B.size(2) == y.size(1), "lora_apply_: A/B do not match x/y");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong,
              "lora_apply_: slots must be int64 [T]");
  const int64_t S = A.size(0);
  const int64_t T = x.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(S);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sp[t];
    TORCH_CHECK(s >= -1 && s < S, "lora_apply_: slot ", s, " out of range [-1, ", S, ")");
    if (s >= 0) rows[s].push_back(t);
  }
  for (int64_t s = 0; s < S; ++s) {
    const auto n = static_cast<int64_t>(rows[s].size());
    if (n == 0) continue;
    if (n == T) {  // the whole batch uses this adapter: no gather or scatter
      y.addmm_(x.mm(A[s].t()), B[s]);
      continue;
    }
    auto idx = at::from_blob(rows[s].data(), {n}, at::TensorOptions().dtype(at::kLong)).clone();
    auto h = x.index_select(0, idx).mm(A[s].t());
    y.index_add_(0, idx, h.mm(B[s]));
  }
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_lora, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor slots) -> ()", &lora_apply_);
}
