"""Fused mixture-of-experts on GPU: a grouped GEMM in Triton over (token, slot) pairs sorted by expert.

The pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M (`align_by_expert`), so
every row block of the sorted order belongs to one expert: a program multiplies its block's rows of the input by
that expert's weight tile. The same kernel runs twice: gate/up (rows gathered from the input tokens, plus the
expert's bias where it has one), then down (rows of the activations, plus bias, scaled by the routing weight); the
activation between them (layers.moe.ExpertActivation) is elementwise torch. Every buffer has a size fixed by
(tokens, top_k, experts), not by how the tokens were routed, so a decode step with this layer can be captured as a
CUDA graph.

Runs compiled on CUDA and on CPU under TRITON_INTERPRET=1 (how the tests run it; see attention/triton_attn.py for
why that variable must be set before triton is first imported).
"""

from __future__ import annotations

import torch

from shoal.engine.execution.layers.activation import SILU

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; fused_experts then uses the torch path
    triton = None
    tl = None

BLOCK_M = 16

if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, b_ptr, c_ptr, weight_ptr, bias_ptr, sorted_slots_ptr, block_expert_ptr,
        num_slots, N, K, row_div,
        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_biase,
        MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """c[slot] = (a[slot // row_div] @ b[expert].T (+ bias[expert])) (* weight[slot]) for the BLOCK_M sorted
        slots of this program's row block, all routed to one expert (-1: padding past the last expert, nothing to
        do)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_slots_ptr + offs_m)
        valid = slots < tl.where(expert >= 0, num_slots, 0)  # padding slots hold num_slots
        rows = tl.where(valid, slots // row_div, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        b_base = b_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
            b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                        mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_biase + offs_n, mask=offs_n < N,
                           other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(weight_ptr + slots, mask=valid, other=0.0)[:, None]
        tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_by_expert(expert_of_slot: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Sort slots by expert, each expert's run padded to a multiple of block_m.

    expert_of_slot: [S] local expert of each (token, slot) pair, num_experts for pairs not handled here.
    Returns (sorted_slots [L], block_expert [L / block_m]): slot ids in expert order with S marking padding, and
    the expert of each row block (-1 for blocks past the last expert). L = S + num_experts * (block_m - 1)
    rounded up to block_m: the most any routing can need, so every size is independent of the routing.
    """
    S = expert_of_slot.numel()
    device = expert_of_slot.device
    # Not torch.bincount: its output size depends on the largest value, which costs a device sync (no capture).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, expert_of_slot, torch.ones_like(expert_of_slot))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(expert_of_slot, stable=True)
    expert_sorted = expert_of_slot[order]
    local = expert_sorted < num_experts
    e = expert_sorted.clamp(max=num_experts - 1)
    rank_in_expert = torch.arange(S, device=device) - start[e]
    length = -(-(S + num_experts * (block_m - 1)) // block_m) * block_m
    dest = torch.where(local, padded_end[e] - padded[e] + rank_in_expert, length)  # elsewhere -> the dump slot
    sorted_slots = torch.full((length + 1,), S, dtype=torch.int64, device=device)
    sorted_slots.scatter_(0, dest, order)
    block_start = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[:length], block_expert


def _gemm(a, b, c, weights, bias, sorted_slots, block_expert, num_slots, row_div, mul_weight):
    N, K = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(N)))
    block_k = min(64, max(16, triton.next_power_of_2(K)))
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, c if bias is None else bias, sorted_slots, block_expert, num_slots, N, K, row_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, expert_start: int = 0, b13: torch.Tensor | None = None,
                         b2: torch.Tensor | None = None, activation=None) -> torch.Tensor:
    """Same contract as layers.moe.fused_experts (x [T, H], w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I], b2 [E, H])."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, top_k = topk_ids.shape
    E, inter = w13.shape[0], w2.shape[2]
    S = T * top_k
    local = topk_ids.reshape(-1) - expert_start
    expert_of_slot = torch.where((local >= 0) & (local < E), local, E)
    sorted_slots, block_expert = align_by_expert(expert_of_slot, E)
    gate_up = torch.empty(S, 2 * inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, topk_weights, b13, sorted_slots, block_expert, S, top_k, False)
    act = (activation or SILU)(gate_up)
    out = torch.zeros(S, x.shape[1], dtype=x.dtype, device=x.device)  # pairs routed elsewhere stay zero
    weights = topk_weights.reshape(-1).float().contiguous()
    _gemm(act, w2, out, weights, b2, sorted_slots, block_expert, S, 1, True)
    return out.view(T, top_k, -1).sum(dim=1)
