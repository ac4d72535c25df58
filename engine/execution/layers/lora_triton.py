"""The gathered LoRA update on GPU in Triton: y[t] += (x[t] @ A[s]^T) @ B[s] with s = slots[t] (-1: base model,
nothing to add), for a batch that mixes adapters (execution/lora.py holds the slot layout).

One program per (token, block of output columns): it reads its token's slot, computes the token's low-rank
activations h = x[t] @ A[s]^T (R values, R = the slots' padded rank) over the input in BLOCK_K tiles, then adds
h @ B[s][:, block] to its output columns. Each token reads only its own adapter's A and B; no program runs per
adapter, and the grid depends only on the batch shape. Runs compiled on CUDA and on CPU under TRITON_INTERPRET=1
(how the tests run it).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; lora.py then uses the masked torch form
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _lora_kernel(x_ptr, a_ptr, b_ptr, y_ptr, slots_ptr, K, N, R,
                     stride_xt, stride_as, stride_ar, stride_bs, stride_br, stride_yt,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        s = tl.load(slots_ptr + t)
        if s >= 0:
            r = tl.arange(0, BLOCK_R)
            r_ok = r < R
            h = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                xv = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
                            mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                h += tl.sum(a * xv[None, :], axis=1)
            n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            b = tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
                        mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            out = tl.sum(b * h[:, None], axis=0)
            y = tl.load(y_ptr + t * stride_yt + n, mask=n_ok, other=0.0)
            tl.store(y_ptr + t * stride_yt + n, (y.to(tl.float32) + out).to(y.dtype), mask=n_ok)


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """In place on y [T, out]: x [T, in], A [S, R, in], B [S, R, out] (contiguous last dims), slots [T] int64."""
    T, K = x.shape
    N, R = y.shape[1], A.shape[1]
    if T == 0:
        return
    x, A, B = x.contiguous(), A.contiguous(), B.contiguous()
    assert y.stride(1) == 1, "lora_apply_triton: y's rows must be contiguous"
    block_n = min(128, triton.next_power_of_2(N))
    grid = (T, triton.cdiv(N, block_n))
    _lora_kernel[grid](x, A, B, y, slots, K, N, R, x.stride(0), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
                       y.stride(0), BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_K=64, BLOCK_N=block_n)
