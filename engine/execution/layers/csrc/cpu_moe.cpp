// Fused mixture-of-experts for CPU: every routed (token, slot) pair is grouped by expert with a counting sort, and
// each expert that received tokens runs as one batch: gather its tokens, one GEMM for gate and up together (oneDNN
// / BLAS through at::mm, plus the expert's bias where it has one), the activation — SiLU(gate) * up, or gpt-oss's
// clamped SwiGLU — one GEMM for down (plus bias), and a weighted scatter-add into the output.
//
// The torch version of the same loop (layers/moe.py, fused_experts_torch) pays ~10 dispatched ops per expert per
// layer plus an argsort; at decode batch sizes with dozens of experts that overhead is most of the MoE layer's time.
// Here it is one call per layer. Accumulation is in float32 whatever the dtype; rows of one expert are distinct
// tokens (top-k never picks an expert twice for a token), so the scatter is parallel over rows without races.
//
// Registered as torch.ops.shoal_cpu_moe.fused_experts; built by layers/moe.py with the same helpers and flags as
// layers/fused.py.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

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
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "fused_experts: topk_ids (int64) and topk_weights (float32) must both be [tokens, top_k]");
  TORCH_CHECK(activation == kSilu || activation == kSwigluClamped, "fused_experts: unknown activation ", activation);
  const int64_t tokens = x.size(0), hidden = x.size(1), num_experts = w13.size(0), inter = w2.size(2);
  for (const auto& [b, cols, name] : {std::tuple{&b13, 2 * inter, "b13"}, std::tuple{&b2, hidden, "b2"}})
    TORCH_CHECK(!b->has_value() || ((*b)->dim() == 2 && (*b)->size(0) == num_experts && (*b)->size(1) == cols &&
                                    (*b)->scalar_type() == x.scalar_type()),
                "fused_experts: ", name, " must be [experts, ", cols, "] in x's dtype");
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Counting sort of the pairs by local expert (stable: a token's pairs keep their order within an expert).
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p] - expert_start;
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  at::Tensor slots = at::empty({offsets[num_experts]}, ids.options());
  at::Tensor rows = at::empty({offsets[num_experts]}, ids.options());
  {
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    int64_t* s = slots.data_ptr<int64_t>();
    int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t e = id[p] - expert_start;
      if (e >= 0 && e < num_experts) {
        s[cursor[e]] = p;
        r[cursor[e]++] = p / top_k;
      }
    }
  }

  at::Tensor acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
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

}  // namespace

TORCH_LIBRARY(shoal_cpu_moe, m) {
  m.def("fused_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int expert_start, "
        "Tensor? b13=None, Tensor? b2=None, int activation=0, float alpha=1.702, float limit=7.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_moe, CPU, m) { m.impl("fused_experts", &fused_experts); }
