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

#include <cstdint>
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

// One token of each of S sequences: q, k [S, Hk, dk], v [S, H, dv], g and beta [S, H]; state [slots, H, dk, dv]
// updated in place at slots [S].
at::Tensor gated_delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots) {
  TORCH_CHECK(state.dim() == 4, "gated_delta_step: state must be [slots, value heads, dk, dv]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "gated_delta_step: int64 slots [S]");
  const int64_t S = q.size(0);
  TORCH_CHECK(slots.size(0) == S, "gated_delta_step: one slot per row");
  const DeltaShape s = check_delta("gated_delta_step", q, k, v, g, beta, state, S);
  const int64_t* slot = slots.contiguous().data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < state.size(0), "gated_delta_step: slot out of range");
  }
  at::Tensor o = at::empty({S, s.H, s.dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = o.data_ptr<float>();
  const int64_t ratio = s.H / s.Hk, head = s.dk * s.dv;
#pragma omp parallel
  {
    std::vector<float> u(s.dv);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < S * s.H; ++w) {
      const int64_t i = w / s.H, h = w % s.H, hk = h / ratio;
      delta_head_step(gp[i * s.H + h], bp[i * s.H + h], qp + (i * s.Hk + hk) * s.dk, kp + (i * s.Hk + hk) * s.dk,
                      vp + (i * s.H + h) * s.dv, sp + (slot[i] * s.H + h) * head, op + (i * s.H + h) * s.dv,
                      u.data(), s.dk, s.dv);
    }
  }
  return o;
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_ssm, m) {
  m.def("selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) state) -> Tensor");
  m.def("selective_state_update(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) state, "
        "Tensor slots) -> Tensor");
  m.def("gated_delta_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state) -> Tensor");
  m.def("gated_delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu_ssm, CPU, m) {
  m.impl("selective_scan", &selective_scan);
  m.impl("selective_state_update", &selective_state_update);
  m.impl("gated_delta_scan", &gated_delta_scan);
  m.impl("gated_delta_step", &gated_delta_step);
}
