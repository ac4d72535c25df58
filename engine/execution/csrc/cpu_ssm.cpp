// The recurrent layers' state updates on CPU, prompt chunks and decode steps, in place on the state slots.
//
// Selective state space (Mamba: a decay per channel and state, Jamba; Mamba2: a decay per head, Granite 4,
// Nemotron-H, Falcon-H1). Per head h (P channels sharing its dt and decay), group g (its B and C), state S [P, N]:
//     S  = exp(dt_h A_h) * S + (dt_h x_h) B_g^T;   y_h = S C_g + D_h x_h
// Gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5). Per value head h (reading key head h / ratio), S [dk, dv]:
//     S  = exp(g_h) S;   u = beta_h (v_h - S^T k);   S += k u^T;   o_h = S^T q
//
// Why C++: these recurrences are sequential in t and their state is large next to a token's input (Granite 4's
// Mamba2 layer: 512 KiB per sequence; Qwen3-Next's DeltaNet: 2 MiB). In torch a decode step gathers each sequence's
// state, makes several full-size temporaries (decayed, outer product, sum) and scatters it back: ~6 passes over the
// state per layer. Here each (sequence, head) is updated where it lives, in two passes (the delta rule) or one
// (Mamba), and a prompt chunk keeps each head's state in L1/L2 across all its tokens (no [L, L] decay tensors of the
// chunked torch forms). Threads own whole heads, so there are no races and no reductions across threads.
//
// Registered as torch.ops.shoal_cpu_ssm.*; built by layers/ssm_scan.py like the other CPU kernels.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "fast_math.h"

namespace {

void check_float(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), op, ": float32, contiguous tensors");
  }
}

// One token through one Mamba/Mamba2 head: S [P, N] in place, y [P].
inline void ssm_head_step(const float* a, int64_t NA, float d, const float* x, const float* b, const float* c,
                          const float* D, float* S, float* y, int64_t P, int64_t N, float* decay) {
  if (NA == 1) {
    const float e = shoal::exp_approx(d * a[0]);
    for (int64_t n = 0; n < N; ++n) decay[n] = e;
  } else {
    for (int64_t n = 0; n < N; ++n) decay[n] = shoal::exp_approx(d * a[n]);
  }
  for (int64_t p = 0; p < P; ++p) {
    const float xv = x[p], u = d * xv;
    float* s = S + p * N;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < N; ++n) {
      const float v = decay[n] * s[n] + u * b[n];
      s[n] = v;
      acc += v * c[n];
    }
    y[p] = acc + D[p] * xv;
  }
}

struct SsmShape {
  int64_t H, P, N, G, NA;
};

SsmShape check_ssm(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const at::Tensor& D, const at::Tensor& state, int64_t rows) {
  TORCH_CHECK(state.dim() >= 3, op, ": state must be [..., heads, head_dim, d_state]");
  const int64_t nd = state.dim();
  const int64_t H = state.size(nd - 3), P = state.size(nd - 2), N = state.size(nd - 1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == rows && x.size(1) == H * P, op, ": x must be [rows, heads * head_dim]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == rows && dt.size(1) == H, op, ": dt must be [rows, heads]");
  TORCH_CHECK(A.dim() == 2 && A.size(0) == H && (A.size(1) == 1 || A.size(1) == N), op,
              ": A must be [heads, 1] or [heads, d_state]");
  TORCH_CHECK(B.dim() == 3 && B.size(0) == rows && B.size(2) == N && C.sizes() == B.sizes(), op,
              ": B and C must be [rows, groups, d_state]");
  const int64_t G = B.size(1);
  TORCH_CHECK(G > 0 && H % G == 0, op, ": the groups must divide the heads");
  TORCH_CHECK(D.numel() == H * P, op, ": D must hold one value per channel");
  check_float(op, {&x, &dt, &A, &B, &C, &D, &state});
  return {H, P, N, G, A.size(1)};
}

// One sequence's chunk: x [T, H*P], dt [T, H], A [H, NA], B and C [T, G, N], D [H*P], state [H, P, N] (in place).
at::Tensor selective_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                          const at::Tensor& C, const at::Tensor& D, at::Tensor& state) {
  TORCH_CHECK(state.dim() == 3, "selective_scan: state must be [heads, head_dim, d_state]");
  const int64_t T = x.size(0);
  const SsmShape s = check_ssm("selective_scan", x, dt, A, B, C, D, state, T);
  at::Tensor y = at::empty({T, s.H * s.P}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t per_group = s.H / s.G, HP = s.H * s.P;
#pragma omp parallel
  {
    std::vector<float> decay(s.N);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / per_group;
      for (int64_t t = 0; t < T; ++t) {
        ssm_head_step(Ap + h * s.NA, s.NA, dtp[t * s.H + h], xp + t * HP + h * s.P, Bp + (t * s.G + g) * s.N,
                      Cp + (t * s.G + g) * s.N, Dp + h * s.P, sp + h * s.P * s.N, yp + t * HP + h * s.P, s.P, s.N,
                      decay.data());
      }
    }
  }
  return y;
}

// One token of each of S sequences: x [S, H*P], dt [S, H], B and C [S, G, N]; state [slots, H, P, N] updated in
// place at slots [S].
at::Tensor selective_state_update(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                  const at::Tensor& C, const at::Tensor& D, at::Tensor& state,
                                  const at::Tensor& slots) {
  TORCH_CHECK(state.dim() == 4, "selective_state_update: state must be [slots, heads, head_dim, d_state]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "selective_state_update: int64 slots [S]");
  const int64_t S = x.size(0);
  TORCH_CHECK(slots.size(0) == S, "selective_state_update: one slot per row");
  const SsmShape s = check_ssm("selective_state_update", x, dt, A, B, C, D, state, S);
  at::Tensor y = at::empty({S, s.H * s.P}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const int64_t* slot = slots.contiguous().data_ptr<int64_t>();
  const int64_t num_slots = state.size(0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "selective_state_update: slot out of range");
  }
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t per_group = s.H / s.G, HP = s.H * s.P, head = s.P * s.N;
#pragma omp parallel
  {
    std::vector<float> decay(s.N);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < S * s.H; ++w) {
      const int64_t i = w / s.H, h = w % s.H, g = h / per_group;
      ssm_head_step(Ap + h * s.NA, s.NA, dtp[i * s.H + h], xp + i * HP + h * s.P, Bp + (i * s.G + g) * s.N,
                    Cp + (i * s.G + g) * s.N, Dp + h * s.P, sp + (slot[i] * s.H + h) * head, yp + i * HP + h * s.P,
                    s.P, s.N, decay.data());
    }
  }
  return y;
}

// One token through one delta-rule head: S [dk, dv] in place, o [dv]; u is scratch [dv].
inline void delta_head_step(float log_decay, float beta, const float* q, const float* k, const float* v, float* S,
                            float* o, float* u, int64_t dk, int64_t dv) {
  const float e = shoal::exp_approx(log_decay);
  for (int64_t j = 0; j < dv; ++j) u[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {  // decay, and S^T k
    float* row = S + i * dv;
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= e;
      u[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    u[j] = beta * (v[j] - u[j]);
    o[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i) {  // the rank-one update, and S^T q
    float* row = S + i * dv;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * u[j];
      o[j] += qi * row[j];
    }
  }
}

struct DeltaShape {
  int64_t Hk, H, dk, dv;
};

DeltaShape check_delta(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state, int64_t rows) {
  const int64_t nd = state.dim();
  const int64_t H = state.size(nd - 3), dk = state.size(nd - 2), dv = state.size(nd - 1);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == rows && q.size(2) == dk && k.sizes() == q.sizes(), op,
              ": q and k must be [rows, key heads, dk]");
  const int64_t Hk = q.size(1);
  TORCH_CHECK(Hk > 0 && H % Hk == 0, op, ": the key heads must divide the value heads");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == rows && v.size(1) == H && v.size(2) == dv, op,
              ": v must be [rows, value heads, dv]");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == rows && g.size(1) == H && beta.sizes() == g.sizes(), op,
              ": g and beta must be [rows, value heads]");
  check_float(op, {&q, &k, &v, &g, &beta, &state});
  return {Hk, H, dk, dv};
}

// One sequence's chunk: q, k [T, Hk, dk], v [T, H, dv], g (log decay) and beta [T, H], state [H, dk, dv].
at::Tensor gated_delta_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& state) {
  TORCH_CHECK(state.dim() == 3, "gated_delta_scan: state must be [value heads, dk, dv]");
  const int64_t T = q.size(0);
  const DeltaShape s = check_delta("gated_delta_scan", q, k, v, g, beta, state, T);
  at::Tensor o = at::empty({T, s.H, s.dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = o.data_ptr<float>();
  const int64_t ratio = s.H / s.Hk;
#pragma omp parallel
  {
    std::vector<float> u(s.dv);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t hk = h / ratio;
      for (int64_t t = 0; t < T; ++t) {
        delta_head_step(gp[t * s.H + h], bp[t * s.H + h], qp + (t * s.Hk + hk) * s.dk, kp + (t * s.Hk + hk) * s.dk,
                        vp + (t * s.H + h) * s.dv, sp + h * s.dk * s.dv, op + (t * s.H + h) * s.dv, u.data(), s.dk,
                        s.dv);
      }
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------------------------------
// The decode step from the projections' outputs, the Triton kernels' interface (layers/ssm_triton.py): rows may be
// strided views (in_proj's splits) as long as each row's values are contiguous; inputs in the model's dtype.

template <typename T>
inline float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t rows) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, op, ": ", name, " must be [rows, ...]");
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) == 1, op, ": ", name, "'s rows must be contiguous");
}

std::vector<int64_t> checked_slots(const char* op, const at::Tensor& slots, int64_t rows, int64_t num_slots) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows, op, ": one slot per row");
  at::Tensor s = slots.to(at::kLong).contiguous();
  std::vector<int64_t> out(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + rows);
  for (int64_t v : out) TORCH_CHECK(v >= 0 && v < num_slots, op, ": slot ", v, " out of range");
  return out;
}

// out[b, c] = SiLU(sum_j window[c, j] w[c, j] + bias[c]), window = conv_state[slot, c, :] then x[b, c]; the state
// shifts by one input. x [B, C], conv_state [slots, C, K - 1], weight [C, K], all the model's dtype.
template <typename T>
void conv_update_impl(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& slot, at::Tensor& out) {
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1);
  const T* xp = x.data_ptr<T>();
  T* sp = conv_state.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), ss0 = conv_state.stride(0), ss1 = conv_state.stride(1), ss2 = conv_state.stride(2);
#pragma omp parallel for collapse(2) schedule(static) if (B * C > 4096)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      T* st = sp + slot[b] * ss0 + c * ss1;
      const T* w = wp + c * K;
      const float xv = ld(xp + b * xs, c);
      float acc = 0.0f;
      for (int64_t j = 0; j < K - 1; ++j) acc += ld(st, j * ss2) * ld(w, j);
      acc += xv * ld(w, K - 1);
      if (bp != nullptr) acc += ld(bp, c);
      for (int64_t j = 0; j + 1 < K - 1; ++j) st[j * ss2] = st[(j + 1) * ss2];
      if (K > 1) st[(K - 2) * ss2] = xp[b * xs + c];
      op[b * C + c] = static_cast<T>(acc / (1.0f + std::exp(-acc)));
    }
  }
}

at::Tensor causal_conv1d_update(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& slots) {
  const char* op = "causal_conv1d_update";
  const int64_t B = x.size(0);
  check_rows(op, "x", x, B);
  const int64_t C = x.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == C && weight.dim() == 2 && weight.size(0) == C &&
                  conv_state.size(2) == weight.size(1) - 1,
              op, ": conv_state [slots, C, K - 1] and weight [C, K] must match x's C");
  TORCH_CHECK(weight.is_contiguous() && (!bias.has_value() || bias->is_contiguous()), op, ": contiguous weight");
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  (!bias.has_value() || bias->scalar_type() == x.scalar_type()),
              op, ": x, conv_state, weight and bias share one dtype");
  const auto slot = checked_slots(op, slots, B, conv_state.size(0));
  at::Tensor out = at::empty({B, C}, x.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d_update",
                                  [&] { conv_update_impl<scalar_t>(x, conv_state, weight, bias, slot, out); });
  return out;
}

// The delta-rule decode step from the conv's output: qkv [B, 2 nk dk + nv dv] (q heads, k heads, v heads), a and b
// [B, nv] raw; q and k L2-normalised (eps 1e-6 inside the root), q scaled by dk^-1/2, g = -exp(A_log) softplus(a +
// dt_bias), beta = sigmoid(b). state [slots, nv, dk, dv] float32 in place; returns o [B, nv, dv] float32.
template <typename T>
void gdn_step_impl(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b, const float* A_log,
                   const float* dt_bias, at::Tensor& state, const std::vector<int64_t>& slot, int64_t nk,
                   at::Tensor& o) {
  const int64_t Bn = qkv.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3), ratio = H / nk;
  const T *qp = qkv.data_ptr<T>(), *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>();
  const int64_t qs = qkv.stride(0), as = a.stride(0), bs = b.stride(0);
  float *sp = state.data_ptr<float>(), *op = o.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
#pragma omp parallel
  {
    std::vector<float> q(dk), k(dk), v(dv), u(dv);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < Bn * H; ++w) {
      const int64_t i = w / H, h = w % H, hk = h / ratio;
      const T* row = qp + i * qs;
      float qq = 0.0f, kk = 0.0f;
      for (int64_t d = 0; d < dk; ++d) {
        q[d] = ld(row, hk * dk + d);
        k[d] = ld(row, nk * dk + hk * dk + d);
        qq += q[d] * q[d];
        kk += k[d] * k[d];
      }
      const float qn = scale / std::sqrt(qq + 1e-6f), kn = 1.0f / std::sqrt(kk + 1e-6f);
      for (int64_t d = 0; d < dk; ++d) {
        q[d] *= qn;
        k[d] *= kn;
      }
      for (int64_t d = 0; d < dv; ++d) v[d] = ld(row, 2 * nk * dk + h * dv + d);
      const float g = -std::exp(A_log[h]) * softplus(ld(ap + i * as, h) + dt_bias[h]);
      const float beta = 1.0f / (1.0f + std::exp(-ld(bp + i * bs, h)));
      delta_head_step(g, beta, q.data(), k.data(), v.data(), sp + (slot[i] * H + h) * dk * dv, op + (i * H + h) * dv,
                      u.data(), dk, dv);
    }
  }
}

at::Tensor gated_delta_rule_step(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& A_log, const at::Tensor& dt_bias, at::Tensor& state,
                                 const at::Tensor& slots, int64_t num_key_heads) {
  const char* op = "gated_delta_rule_step";
  const int64_t Bn = qkv.size(0);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"qkv", &qkv}, {"a", &a}, {"b", &b}}) {
    check_rows(op, name, *t, Bn);
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), op, ": qkv, a and b share one dtype");
  }
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(), op,
              ": state must be float32 [slots, nv, dk, dv], contiguous");
  const int64_t H = state.size(1), dk = state.size(2), dv = state.size(3), nk = num_key_heads;
  TORCH_CHECK(nk > 0 && H % nk == 0 && qkv.size(1) == 2 * nk * dk + H * dv && a.size(1) == H && b.size(1) == H, op,
              ": qkv has ", qkv.size(1), " channels; ", nk, " key heads and the state's ", H, " x [", dk, ", ", dv,
              "] need ", 2 * nk * dk + H * dv);
  at::Tensor A = A_log.to(at::kFloat).contiguous(), db = dt_bias.to(at::kFloat).contiguous();
  TORCH_CHECK(A.numel() == H && db.numel() == H, op, ": A_log and dt_bias [nv]");
  const auto slot = checked_slots(op, slots, Bn, state.size(0));
  at::Tensor o = at::empty({Bn, H, dv}, qkv.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "gated_delta_rule_step", [&] {
    gdn_step_impl<scalar_t>(qkv, a, b, A.data_ptr<float>(), db.data_ptr<float>(), state, slot, nk, o);
  });
  return o;
}

// The Mamba2 decode step from the conv's output: xbc [S, H P + 2 G N] (x heads, then B and C per group), dt [S, H]
// raw (+ dt_bias, softplus, clamped to [lo, hi]); A (negative) and D [H]; state [slots, H, P, N] float32 in place.
// Returns y [S, H, P] float32, the D skip included.
template <typename T>
void mamba2_step_impl(const at::Tensor& xbc, const at::Tensor& dt, const float* dtb, const float* A, const float* D,
                      at::Tensor& state, const std::vector<int64_t>& slot, int64_t G, float lo, float hi,
                      at::Tensor& y) {
  const int64_t S = xbc.size(0), H = state.size(1), P = state.size(2), N = state.size(3), per_group = H / G;
  const T *xp = xbc.data_ptr<T>(), *dp = dt.data_ptr<T>();
  const int64_t xs = xbc.stride(0), ds = dt.stride(0), HP = H * P;
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
#pragma omp parallel
  {
    std::vector<float> x(P), Bv(N), Cv(N), Dh(P), decay(N);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < S * H; ++w) {
      const int64_t i = w / H, h = w % H, g = h / per_group;
      const T* row = xp + i * xs;
      for (int64_t p = 0; p < P; ++p) {
        x[p] = ld(row, h * P + p);
        Dh[p] = D[h];
      }
      for (int64_t n = 0; n < N; ++n) {
        Bv[n] = ld(row, HP + g * N + n);
        Cv[n] = ld(row, HP + G * N + g * N + n);
      }
      float d = softplus(ld(dp + i * ds, h) + dtb[h]);
      d = std::min(std::max(d, lo), hi);
      ssm_head_step(A + h, 1, d, x.data(), Bv.data(), Cv.data(), Dh.data(), sp + (slot[i] * H + h) * P * N,
                    yp + (i * H + h) * P, P, N, decay.data());
    }
  }
}

at::Tensor mamba2_ssm_step(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& dt_bias, const at::Tensor& A,
                           const at::Tensor& D, at::Tensor& state, const at::Tensor& slots, int64_t groups,
                           double lo, double hi) {
  const char* op = "mamba2_ssm_step";
  const int64_t S = xbc.size(0);
  check_rows(op, "xbc", xbc, S);
  check_rows(op, "dt", dt, S);
  TORCH_CHECK(dt.scalar_type() == xbc.scalar_type(), op, ": xbc and dt share one dtype");
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(), op,
              ": state must be float32 [slots, H, P, N], contiguous");
  const int64_t H = state.size(1), P = state.size(2), N = state.size(3);
  TORCH_CHECK(groups > 0 && H % groups == 0 && xbc.size(1) == H * P + 2 * groups * N && dt.size(1) == H, op,
              ": xbc has ", xbc.size(1), " channels; ", groups, " groups and the state's ", H, " x [", P, ", ", N,
              "] need ", H * P + 2 * groups * N);
  at::Tensor db = dt_bias.to(at::kFloat).contiguous(), Af = A.to(at::kFloat).contiguous();
  at::Tensor Df = D.to(at::kFloat).contiguous();
  TORCH_CHECK(db.numel() == H && Af.numel() == H && Df.numel() == H, op, ": dt_bias, A and D [H]");
  const auto slot = checked_slots(op, slots, S, state.size(0));
  at::Tensor y = at::empty({S, H, P}, xbc.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xbc.scalar_type(), "mamba2_ssm_step", [&] {
    mamba2_step_impl<scalar_t>(xbc, dt, db.data_ptr<float>(), Af.data_ptr<float>(), Df.data_ptr<float>(), state,
                               slot, groups, static_cast<float>(lo), static_cast<float>(hi), y);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_ssm, m) {
  m.def("selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) state) -> Tensor");
  m.def("selective_state_update(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) state, "
        "Tensor slots) -> Tensor");
  m.def("gated_delta_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state) -> Tensor");
  m.def("causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor slots) -> Tensor");
  m.def("gated_delta_rule_step(Tensor qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, Tensor(a!) state, "
        "Tensor slots, int num_key_heads) -> Tensor");
  m.def("mamba2_ssm_step(Tensor xbc, Tensor dt, Tensor dt_bias, Tensor A, Tensor D, Tensor(a!) state, Tensor slots, "
        "int groups, float lo, float hi) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_ssm, CPU, m) {
  m.impl("selective_scan", &selective_scan);
  m.impl("selective_state_update", &selective_state_update);
  m.impl("gated_delta_scan", &gated_delta_scan);
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("gated_delta_rule_step", &gated_delta_rule_step);
  m.impl("mamba2_ssm_step", &mamba2_ssm_step);
}
