// Fused mixture-of-experts for CPU: every routed (token, slot) pair is grouped by expert with a counting sort, and
// each expert that received tokens runs as one batch: gather its tokens, one GEMM for gate and up together (oneDNN
// / BLAS through at::mm), SiLU(gate) * up, one GEMM for down, and a weighted scatter-add into the output.
//
// The torch version of the same loop (layers/moe.py, fused_experts_torch) pays ~10 dispatched ops per expert per
// layer plus an argsort; at decode batch sizes with dozens of experts that overhead is most of the MoE layer's time.
// Here it is one call per layer. Accumulation is in float32 whatever the dtype; rows of one expert are distinct
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

#include <cmath>
#include <cstdint>
#include <vector>

#include "gguf_matmul.h"

namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements below which OpenMP's fork/join costs more than it saves

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = gate_up.size(0), inter = out.size(1);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t ld = gate_up.stride(0);
#pragma omp parallel for if (n * inter >= kParallelMin)
  for (int64_t r = 0; r < n; ++r) {
    const T* g = src + r * ld;
    const T* u = g + inter;
    T* o = dst + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gv = static_cast<float>(g[i]);
      // Round SiLU(gate) to T before the product, as the torch reference (silu, then mul) does.
      const T s = static_cast<T>(gv / (1.0f + std::exp(-gv)));
      o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
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

void check_routing(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "fused_experts: topk_ids (int64) and topk_weights (float32) must both be [tokens, top_k]");
}

// x [T, H]; w13 [E_local, 2I, H] (gate rows then up rows); w2 [E_local, H, I]; topk_weights [T, k] float32;
// topk_ids [T, k] int64 global expert ids. Experts [expert_start, expert_start + E_local) are this rank's; pairs
// routed elsewhere contribute nothing here. Returns [T, H] in x's dtype.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fused_experts: x must be a row-major [tokens, hidden] matrix");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0), "fused_experts: bad expert weights");
  TORCH_CHECK(w13.size(2) == x.size(1) && w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "fused_experts: expert weight shapes do not match the hidden size");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_experts: weights and activations must share a dtype");
  check_routing(x, topk_weights, topk_ids);
  const int64_t tokens = x.size(0), hidden = x.size(1), num_experts = w13.size(0), inter = w2.size(2);
  const int64_t top_k = topk_ids.size(1);
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = sort_by_expert(topk_ids, num_experts, expert_start);
  const std::vector<int64_t>& offsets = routing.offsets;
  const at::Tensor& rows = routing.rows;

  at::Tensor acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  const int64_t* slot_ptr = routing.slots.data_ptr<int64_t>();
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;  // an expert no token chose costs nothing
    const at::Tensor xe = x.index_select(0, rows.narrow(0, offsets[e], n));
    const at::Tensor gate_up = at::mm(xe, w13[e].t());
    at::Tensor act = at::empty({n, inter}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_experts", [&] {
      silu_mul_rows<scalar_t>(gate_up, act);
      const at::Tensor y = at::mm(act, w2[e].t());
      scatter_add_rows<scalar_t>(y, slot_ptr + offsets[e], weights.data_ptr<float>(), top_k, acc.data_ptr<float>(),
                                 hidden);
    });
  }
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
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
  m.def("fused_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int expert_start)"
        " -> Tensor");
  m.def("fused_experts_gguf(Tensor x, Tensor gate, Tensor up, Tensor down, int gate_type, int up_type, "
        "int down_type, Tensor topk_weights, Tensor topk_ids, int expert_start) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_moe, CPU, m) {
  m.impl("fused_experts", &fused_experts);
  m.impl("fused_experts_gguf", &fused_experts_gguf);
}
