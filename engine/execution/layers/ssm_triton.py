"""Triton kernels for the hybrids' decode step (one token per sequence, batched over sequences), each reading and
writing its sequence's state slot in place (no gathered copy of the state):

- `causal_conv1d_update`: shift the new input into a sequence's conv window, the depthwise conv (+ bias), SiLU
  (Gated DeltaNet and Mamba2 alike);
- `gated_delta_rule_step`: Gated DeltaNet's delta-rule update and output from the conv's output (q and k
  L2-normalised, q scaled, each value head reading its key head, in the kernel), with its gating (g = -exp(A_log) *
  softplus(a + dt_bias)) and beta = sigmoid(b) computed in the kernel from the raw projections;
- `mamba2_ssm_step`: Mamba2's state update and output from the conv's output (x, and each head's group's B and C,
  read in place), with dt = clamp(softplus(dt + dt_bias), limits) and the D skip in the kernel.

The equations are those of layers/gated_delta_net.py (`recurrent_step`) and layers/mamba2.py (`ssm_step`), whose
torch code stays the fallback; `use_triton` is the one place that decides (CUDA by default, forced either way by
SHOAL_SSM_TRITON=1/0; SHOAL_DISABLE_FUSED_OPS=1 turns it off like the other fused paths). Everything is float32
inside; each program owns whole output columns of its state tile, so splitting a head's state over programs is exact.

Runs compiled on CUDA and on CPU under TRITON_INTERPRET=1 (how the tests run it; see attention/triton_attn.py for
why that variable must be set before triton is first imported).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; the layers then use their torch code
    triton = None
    tl = None


def use_triton(device: torch.device) -> bool:
    """Whether the hybrids' decode step runs these kernels on `device`: on CUDA when triton is installed, unless
    SHOAL_SSM_TRITON=0 (or SHOAL_DISABLE_FUSED_OPS=1); SHOAL_SSM_TRITON=1 forces them anywhere (on CPU only under
    TRITON_INTERPRET=1, how the tests compare them with the torch path)."""
    if triton is None or os.environ.get("SHOAL_DISABLE_FUSED_OPS") == "1":
        return False
    mode = os.environ.get("SHOAL_SSM_TRITON", "auto")
    if mode == "1":
        return True
    return mode != "0" and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _softplus(x):
        # torch's F.softplus (beta 1, threshold 20)
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))

    @triton.jit
    def _conv_update_kernel(
        x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, slots_ptr, C,
        stride_xb, stride_xc, stride_ss, stride_sc, stride_sk, stride_wc, stride_wk, stride_ob, stride_oc,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out[b, c] = SiLU(sum_j window[c, j] w[c, j] (+ bias[c])) with window = state[slot, c, :] then x[b, c];
        state[slot, c, :] <- window[c, 1:]."""
        b = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_k = tl.arange(0, BLOCK_K)
        cmask = offs_c < C
        slot = tl.load(slots_ptr + b).to(tl.int64)
        s_base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
        x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + offs_c * stride_xc, mask=cmask, other=0.0).to(tl.float32)
        # window column j: the state's column j for j < K - 1, the new input at j = K - 1
        from_state = cmask[:, None] & (offs_k[None, :] < K - 1)
        win = tl.load(s_base + offs_k[None, :] * stride_sk, mask=from_state, other=0.0).to(tl.float32)
        win = tl.where(offs_k[None, :] == K - 1, x[:, None], win)
        w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :] * stride_wk,
                    mask=cmask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc = tl.sum(win * w, axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + offs_c * stride_oc, out.to(out_ptr.dtype.element_ty),
                 mask=cmask)
        # the new state: window columns 1..K-1 (loaded again shifted by one, before anything is written)
        shifted_state = cmask[:, None] & (offs_k[None, :] + 1 < K - 1)
        nxt = tl.load(s_base + (offs_k[None, :] + 1) * stride_sk, mask=shifted_state, other=0.0)
        nxt = tl.where(offs_k[None, :] + 1 == K - 1, x[:, None].to(nxt.dtype), nxt)
        tl.debug_barrier()
        tl.store(s_base + offs_k[None, :] * stride_sk, nxt.to(state_ptr.dtype.element_ty),
                 mask=cmask[:, None] & (offs_k[None, :] < K - 1))

    @triton.jit
    def _gdn_step_kernel(
        qkv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, o_ptr, slots_ptr, DK, DV, KD, RATIO, q_scale,
        stride_qkvb, stride_ab, stride_bb, stride_ss, stride_sh, stride_sk, stride_sv, stride_ob, stride_oh,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """One (sequence, value head, block of value columns): q and k of the head's key head L2-normalised (q
        scaled), then S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q."""
        bi = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        kh = h // RATIO  # the key head this value head reads
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask, vmask = offs_k < DK, offs_v < DV
        row = qkv_ptr + bi * stride_qkvb
        q = tl.load(row + kh * DK + offs_k, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(row + KD + kh * DK + offs_k, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KD + h * DV + offs_v, mask=vmask, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * q_scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        a = tl.load(a_ptr + bi * stride_ab + h).to(tl.float32)
        braw = tl.load(b_ptr + bi * stride_bb + h).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + h)) * _softplus(a + tl.load(dtb_ptr + h))
        beta = 1.0 / (1.0 + tl.exp(-braw))
        slot = tl.load(slots_ptr + bi).to(tl.int64)
        ptrs = (state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk
                + offs_v[None, :] * stride_sv)
        mask = kmask[:, None] & vmask[None, :]
        s = tl.load(ptrs, mask=mask, other=0.0) * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        tl.store(ptrs, s, mask=mask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + bi * stride_ob + h * stride_oh + offs_v, o, mask=vmask)

    @triton.jit
    def _mamba2_step_kernel(
        xbc_ptr, dt_ptr, dtb_ptr, A_ptr, D_ptr, state_ptr, y_ptr, slots_ptr, P, N, INNER, GN, HEADS_PER_GROUP,
        dt_lo, dt_hi, stride_xbc, stride_dts, stride_ss, stride_sh, stride_sp, stride_sn, stride_ys, stride_yh,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One (sequence, head, block of head-dim rows), x and its group's B and C read from the conv's output:
        dt = clamp(softplus(dt + dt_bias)); S <- e^{dt A} S + dt x B^T; y = S C + D x."""
        si = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        grp = h // HEADS_PER_GROUP
        offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        pmask, nmask = offs_p < P, offs_n < N
        row = xbc_ptr + si * stride_xbc
        x = tl.load(row + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)
        Bv = tl.load(row + INNER + grp * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
        Cv = tl.load(row + INNER + GN + grp * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
        dt = _softplus(tl.load(dt_ptr + si * stride_dts + h).to(tl.float32) + tl.load(dtb_ptr + h))
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        A = tl.load(A_ptr + h)
        slot = tl.load(slots_ptr + si).to(tl.int64)
        ptrs = (state_ptr + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp
                + offs_n[None, :] * stride_sn)
        mask = pmask[:, None] & nmask[None, :]
        s = tl.load(ptrs, mask=mask, other=0.0) * tl.exp(dt * A) + (x * dt)[:, None] * Bv[None, :]
        tl.store(ptrs, s, mask=mask)
        y = tl.sum(s * Cv[None, :], axis=1) + tl.load(D_ptr + h) * x
        tl.store(y_ptr + si * stride_ys + h * stride_yh + offs_p, y, mask=pmask)


def _check(name: str, t: torch.Tensor) -> None:
    """The kernels index the last dimension with unit stride (views such as in_proj's splits are fine)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """x [B, C] (one new input per sequence), conv_state [slots, C, K - 1] (updated in place at `slots` [B]),
    weight [C, K], bias [C] or None. Returns SiLU(conv) [B, C] in x's dtype."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, C = x.shape
    K = weight.shape[1]
    if conv_state.shape[1] != C or conv_state.shape[2] != K - 1:
        raise ValueError(f"conv state {tuple(conv_state.shape[1:])} does not match {C} channels, kernel {K}")
    out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    block_c = min(256, triton.next_power_of_2(C))
    _conv_update_kernel[(B, triton.cdiv(C, block_c))](
        x, conv_state, weight, weight if bias is None else bias, out, slots, C,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        K=K, HAS_BIAS=bias is not None, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(K),
    )
    return out


def gated_delta_rule_step(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                          num_key_heads: int) -> torch.Tensor:
    """qkv [B, 2 nk dk + nv dv] (the conv's output: q heads, k heads, v heads; the kernel L2-normalises q and k,
    scales q by dk^-1/2, and gives value head h key head h // (nv / nk)), a and b [B, nv] (the raw projections: the
    kernel forms g and beta), A_log and dt_bias [nv] float32, state [slots, nv, dk, dv] float32 (updated in place
    at `slots` [B]). Returns o [B, nv, dv] float32."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    for name, t in (("qkv", qkv), ("a", a), ("b", b)):
        _check(name, t)
    Bn = qkv.shape[0]
    H, DK, DV = state.shape[1:]
    if H % num_key_heads or qkv.shape[1] != 2 * num_key_heads * DK + H * DV:
        raise ValueError(f"qkv has {qkv.shape[1]} channels; {num_key_heads} key heads and the state's {H} x "
                         f"[{DK}, {DV}] need {2 * num_key_heads * DK + H * DV}")
    o = torch.empty(Bn, H, DV, dtype=torch.float32, device=qkv.device)
    if Bn == 0:
        return o
    block_v = min(32, triton.next_power_of_2(DV))
    _gdn_step_kernel[(Bn, H, triton.cdiv(DV, block_v))](
        qkv, a, b, A_log.contiguous(), dt_bias.contiguous(), state, o, slots, DK, DV, num_key_heads * DK,
        H // num_key_heads, DK ** -0.5,
        qkv.stride(0), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), o.stride(0), o.stride(1),
        BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=block_v,
    )
    return o


def mamba2_ssm_step(xbc: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                    state: torch.Tensor, slots: torch.Tensor, groups: int,
                    time_step_limit: tuple[float, float]) -> torch.Tensor:
    """xbc [S, H P + 2 G N] (the conv's output: x heads, then B and C, one d_state vector per group of H / G
    heads), dt [S, H] (raw: the kernel adds dt_bias, softplus, clamps to time_step_limit), dt_bias, A (negative) and
    D [H] float32, state [slots, H, P, N] float32 (updated in place at `slots` [S]). Returns y [S, H, P] float32,
    the D skip included."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    for name, t in (("xbc", xbc), ("dt", dt)):
        _check(name, t)
    S = xbc.shape[0]
    H, P, N = state.shape[1:]
    if H % groups or xbc.shape[1] != H * P + 2 * groups * N:
        raise ValueError(f"xbc has {xbc.shape[1]} channels; {groups} groups and the state's {H} x [{P}, {N}] need "
                         f"{H * P + 2 * groups * N}")
    y = torch.empty(S, H, P, dtype=torch.float32, device=xbc.device)
    if S == 0:
        return y
    block_p = min(32, triton.next_power_of_2(P))
    lo, hi = time_step_limit
    _mamba2_step_kernel[(S, H, triton.cdiv(P, block_p))](
        xbc, dt, dt_bias.contiguous(), A.contiguous(), D.contiguous(), state, y, slots, P, N, H * P, groups * N,
        H // groups, float(lo), float(hi),
        xbc.stride(0), dt.stride(0), state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        y.stride(0), y.stride(1),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
    )
    return y
