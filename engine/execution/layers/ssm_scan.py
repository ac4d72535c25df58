"""The recurrent layers' state updates as C++ kernels on CPU (csrc/cpu_ssm.cpp): Mamba's and Mamba2's selective
scan and Gated DeltaNet's delta rule for a prompt chunk of one sequence, and for one decode token of many, in place on
the state slots: Mamba's update, and (`decode_kernels`, the Triton kernels' interface) the causal-conv update, the
delta-rule step and the Mamba2 step straight from the projections' outputs.

`kernels_for(t)` is torch.ops.shoal_cpu_ssm for a CPU tensor, else None: off CPU, when the kernel cannot be built (no
compiler), or with SHOAL_DISABLE_SSM_KERNEL=1 — the layers then run their torch forms. The Mamba recurrence's torch
form lives here (`selective_scan_reference`); Gated DeltaNet's and Mamba2's chunked forms in their layers.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)


@functools.cache
def load_kernels():
    """torch.ops.shoal_cpu_ssm, or None (disabled, or no compiler: the torch forms run)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    if os.environ.get("SHOAL_DISABLE_SSM_KERNEL") == "1":
        return None
    try:
        return kernel_ops("ssm")
    except NativeBuildError as e:
        logger.warning("%s; the recurrent layers run in torch", e)
        return None


def kernels_for(t: torch.Tensor):
    return load_kernels() if t.device.type == "cpu" else None


class CpuDecode:
    """The decode step's fused kernels in C++, with layers/ssm_triton.py's interface (the layers call either)."""

    def __init__(self, ops):
        self.ops = ops

    def causal_conv1d_update(self, x, conv_state, weight, bias, slots):
        return self.ops.causal_conv1d_update(x, conv_state, weight, bias, slots)

    def gated_delta_rule_step(self, qkv, a, b, A_log, dt_bias, state, slots, num_key_heads):
        return self.ops.gated_delta_rule_step(qkv, a, b, A_log, dt_bias, state, slots, num_key_heads)

    def mamba2_ssm_step(self, xbc, dt, dt_bias, A, D, state, slots, groups, time_step_limit):
        lo, hi = time_step_limit
        return self.ops.mamba2_ssm_step(xbc, dt, dt_bias, A, D, state, slots, groups, float(lo), float(hi))


def decode_kernels(device: torch.device):
    """The fused decode kernels for `device`: Triton's on CUDA (ssm_triton.use_triton), these C++ ones on CPU, else
    None (the layers' torch step)."""
    from shoal.engine.execution.layers import ssm_triton

    if ssm_triton.use_triton(device):
        return ssm_triton
    ops = load_kernels() if device.type == "cpu" else None
    return CpuDecode(ops) if ops is not None else None


def selective_scan(x, dt, A, B, C, D, state):
    """One sequence's chunk, float32. x: [T, H, P]; dt: [T, H] (after softplus); A: [H, 1] or [H, N] (negative);
    B, C: [T, G, N] (G groups dividing the H heads, each head reading its group's); D: [H, P]; state: [H, P, N],
    updated in place. Returns y [T, H, P] with the D skip:
        S <- exp(dt A) S + dt x B^T;   y = S C + D x."""
    T, H, P = x.shape
    ops = kernels_for(x)
    if ops is not None and state.is_contiguous():
        y = ops.selective_scan(x.reshape(T, H * P).contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
                               C.contiguous(), D.reshape(-1).contiguous(), state)
        return y.view(T, H, P)
    return selective_scan_reference(x, dt, A, B, C, D, state)


def selective_state_update(x, dt, A, B, C, D, state, slots):
    """One token of each of S sequences (the decode step), float32: x [S, H, P], dt [S, H], B, C [S, G, N], the
    others as selective_scan's; state [slots, H, P, N] updated in place at `slots` [S]. Returns y [S, H, P]."""
    S, H, P = x.shape
    ops = kernels_for(x)
    if ops is not None and state.is_contiguous():
        y = ops.selective_state_update(x.reshape(S, H * P).contiguous(), dt.contiguous(), A.contiguous(),
                                       B.contiguous(), C.contiguous(), D.reshape(-1).contiguous(), state,
                                       slots.long())
        return y.view(S, H, P)
    per_group = H // B.shape[1]
    Bh, Ch = B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1)  # [S, H, N]
    s = state.index_select(0, slots)
    s.mul_((dt[..., None] * A).exp()[:, :, None, :]).add_((x * dt[..., None])[..., None] * Bh[:, :, None, :])
    state.index_copy_(0, slots, s)
    return (s * Ch[:, :, None, :]).sum(-1) + D * x


def gated_delta_scan(ops, q, k, v, g, beta, state):
    """One sequence's chunk through the delta rule in the kernel, float32: q, k [T, Hk, dk] (key heads), v [T, H, dv],
    g (log decay) and beta [T, H]; state [H, dk, dv] updated in place. Returns o [T, H, dv]."""
    return ops.gated_delta_scan(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                                state)


def selective_scan_reference(x, dt, A, B, C, D, state):
    """The recurrence in torch, one token at a time (the same arguments as selective_scan)."""
    T, H, _ = x.shape
    per_group = H // B.shape[1]
    Bh, Ch = B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1)  # [T, H, N]
    y = torch.empty_like(x)
    for t in range(T):
        decay = (dt[t, :, None] * A).exp()[:, None, :]  # [H, 1, N or 1]
        state.mul_(decay).add_((x[t] * dt[t, :, None])[..., None] * Bh[t, :, None, :])
        y[t] = (state * Ch[t, :, None, :]).sum(-1)
    return y + D * x
