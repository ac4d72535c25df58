"""Fused decoder-layer steps: residual add + RMSNorm (also Gemma's (1 + w) form), SwiGLU, GeGLU (tanh), RoPE in
place on a fused QKV projection.

Each function has a torch reference (`*_reference`, the exact op sequence the unfused layers ran) and, on CPU, a
C++ kernel (csrc/cpu_fused_ops.cpp) that does the same arithmetic in one call: in a decode step these steps touch
only batch x hidden values, so their cost was the 3-9 torch ops each was made of (dispatch, temporaries), paid
per layer. Off CPU, or when the kernel cannot be built (no compiler), the reference runs: on CUDA, graph capture
removes the launch overhead instead.

The kernel is compiled on first use for this process's CPU tier, like the CPU attention kernel (see
execution/native_build.py). SHOAL_DISABLE_FUSED_OPS=1 forces the reference path (for comparisons).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load_kernels() -> tuple[object | None, str, float]:
    """(torch.ops.shoal_cpu_fused or None, why not, seconds spent building/loading)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    start = time.perf_counter()
    if os.environ.get("SHOAL_DISABLE_FUSED_OPS") == "1":
        return None, "disabled by SHOAL_DISABLE_FUSED_OPS=1", 0.0
    try:
        ops = kernel_ops("fused_ops")
    except NativeBuildError as e:  # never fatal: use the reference ops
        logger.warning("%s; using the unfused torch ops", e)
        return None, str(e), time.perf_counter() - start
    return ops, "", time.perf_counter() - start


def _kernels_for(t: torch.Tensor):
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        return None
    return load_kernels()[0]


# ---------------------------------------------------------------------------------------- residual + RMSNorm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Reduced precision: normalise in float32, round, then scale — the reference's exact rounding steps.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's norm: the checkpoint stores w and the scale is (1 + w), applied in float32 before one rounding."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, unit_offset: bool = False) -> torch.Tensor:
    if delta is not None:
        residual.add_(delta)
    if unit_offset:
        return gemma_rms_norm_reference(residual, weight, eps)
    return rms_norm_reference(residual, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, unit_offset: bool = False) -> torch.Tensor:
    """rms_norm(residual + delta) * weight (unit_offset: * (1 + weight), Gemma's form), with `residual += delta`
    done in place (the residual stream moves on); `delta=None` normalises residual alone and leaves it
    unchanged."""
    ops = _kernels_for(residual)
    if ops is None or residual.dim() != 2 or residual.stride(1) != 1 or (
            delta is not None and (delta.dtype != residual.dtype or delta.stride(-1) != 1)):
        return add_rms_norm_reference(residual, delta, weight, eps, unit_offset)
    out = torch.empty_like(residual)
    ops.add_rms_norm(out, residual, delta, weight, eps, unit_offset)
    return out


# ------------------------------------------------------------------------------------------------------ SwiGLU


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _gated(gate_up: torch.Tensor, kernel: str, reference) -> torch.Tensor:
    """act(gate) * up through the C++ op `kernel` where it runs (2-D, contiguous features), else `reference`."""
    ops = _kernels_for(gate_up)
    if ops is None or gate_up.dim() != 2 or gate_up.stride(1) != 1:
        return reference(gate_up)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    getattr(ops, kernel)(out, gate_up)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim (a merged gate/up projection's output)."""
    return _gated(gate_up, "silu_and_mul", silu_and_mul_reference)


# ------------------------------------------------------------------------------------------------------- GeGLU


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [gate | up] along the last dim (Gemma's GeGLU)."""
    return _gated(gate_up, "gelu_tanh_and_mul", gelu_tanh_and_mul_reference)


# -------------------------------------------------------------------------------------------------------- RoPE


def rotary_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int, head_dim: int) -> None:
    T = qkv.shape[0]
    x = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x.copy_(x * c + torch.roll(x, head_dim // 2, dims=-1) * s)


def rotary_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
            head_dim: int) -> None:
    """Rotate, in place, the first `heads` heads of each row of qkv [T, >= heads * head_dim] (the queries and keys
    of a fused projection) by their token's position. Tables: cos = [cos, cos], sin = [-sin, sin] per position,
    so that x * cos + roll(x, head_dim / 2) * sin is the rotation (RotaryEmbedding builds them)."""
    ops = _kernels_for(qkv)
    if ops is None or qkv.dim() != 2 or qkv.stride(1) != 1 or positions.dtype != torch.int64:
        return rotary_reference(qkv, positions, cos, sin, heads, head_dim)
    ops.rotary_embedding(qkv, positions.contiguous(), cos, sin, heads, head_dim)
