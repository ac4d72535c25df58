"""GGUF weights run packed on GPU: Triton kernels that dequantize Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks in registers.

The packed rows are the file's bytes, moved to the GPU as they are (uint8 [rows, row_bytes], the CPU kernel's
layout; quantization/gguf.py). `matmul` computes y = x @ W.T + bias: each program owns a [BLOCK_M, BLOCK_N] tile
of y and walks K one group of 32 weights at a time, decoding that group of its BLOCK_N rows (scales and quants
read from the block bytes, the fp16 scales by bit casts) into a float32 [32, BLOCK_N] tile, then tl.dot with the
activations in float32: exact ("ieee") for float32 activations, TF32 tensor cores for 16-bit ones (whose own
rounding is coarser; the weights then stay exact rather than rounded to bfloat16 as a dequantized model's are). The K-quants' 256-weight superblocks are read a group of 32 at a time as well (Q4_K: one 6-bit
scale and min per group; Q6_K: one int8 scale per 16). `dequantize_rows` decodes whole rows (the embedding
lookup, and the dequantized fallback). Both run compiled on CUDA and on CPU under TRITON_INTERPRET=1 (how the
tests run them against the `gguf` package's dequantization).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; GGUF files on GPU are then dequantized on load
    triton = None
    tl = None

GROUP = 32  # weights decoded per step: every type's blocks split into groups of 32
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}  # GGML type id -> bytes per block
BLOCK_WEIGHTS = {2: 32, 3: 32, 8: 32, 12: 256, 14: 256}

if triton is not None:

    @triton.jit
    def _fp16_at(ptr, mask):
        """The little-endian fp16 at byte pointers `ptr`, as float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _decode(w_ptr, rows, cols, row_bytes, mask, QTYPE: tl.constexpr):
        """Weights W[rows, cols] (broadcast index tensors) of the packed matrix at w_ptr, float32."""
        row = w_ptr + rows.to(tl.int64) * row_bytes
        if QTYPE == 8:  # Q8_0: d, int8 q[32]
            blk = row + (cols // 32) * 34
            q = tl.load(blk + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = _fp16_at(blk, mask) * q
        elif QTYPE == 2 or QTYPE == 3:  # Q4_0: d, q[16] / Q4_1: d, m, q[16]; low nibbles 0-15, high 16-31
            size = 18 if QTYPE == 2 else 20
            start = 2 if QTYPE == 2 else 4
            blk = row + (cols // 32) * size
            j = cols % 32
            nib = ((_u8(blk + start + j % 16, mask) >> ((j // 16) * 4)) & 15).to(tl.float32)
            d = _fp16_at(blk, mask)
            if QTYPE == 2:
                w = d * (nib - 8.0)
            else:
                w = d * nib + _fp16_at(blk + 2, mask)
        elif QTYPE == 12:  # Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) per group of 32, q[128]
            blk = row + (cols // 256) * 144
            t = cols % 256
            g = t // 32
            s = blk + 4
            lo_g = g < 4
            a = _u8(s + g % 4, mask)  # s[g] (g < 4) or s[g - 4]
            b = _u8(s + g % 4 + 4, mask)  # s[g + 4] (g < 4) or s[g]
            c = _u8(s + 8 + g % 4, mask)  # s[g + 4] for g >= 4
            sc = tl.where(lo_g, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
            mn = tl.where(lo_g, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
            nib = ((_u8(blk + 16 + (g // 2) * 32 + t % 32, mask) >> ((g % 2) * 4)) & 15).to(tl.float32)
            w = _fp16_at(blk, mask) * sc * nib - _fp16_at(blk + 2, mask) * mn
        else:  # Q6_K: ql[128], qh[64], int8 scales[16], d; a half of 128 weights holds four runs of 32
            blk = row + (cols // 256) * 210
            t = cols % 256
            half = t // 128
            run = (t % 128) // 32
            l = t % 32
            low = (_u8(blk + half * 64 + (run % 2) * 32 + l, mask) >> ((run // 2) * 4)) & 15
            high = (_u8(blk + 128 + half * 32 + l, mask) >> (run * 2)) & 3
            sc = tl.load(blk + 192 + half * 8 + run * 2 + l // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = _fp16_at(blk + 208, mask) * sc.to(tl.float32) * ((low | (high << 4)) - 32).to(tl.float32)
        return w

    @triton.jit
    def _gguf_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                            QTYPE: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, 32):
            offs_k = k0 + tl.arange(0, 32)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M), other=0.0)
            w_mask = offs_n[None, :] < N
            w = _decode(w_ptr, offs_n[None, :], offs_k[:, None], row_bytes, w_mask, QTYPE)  # [32, BLOCK_N]
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _gguf_dequantize_kernel(w_ptr, ids_ptr, out_ptr, K, row_bytes, QTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """out[i, :] = row ids[i] of the packed matrix, float32."""
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < K
        row = tl.load(ids_ptr + i)
        w = _decode(w_ptr, row + offs * 0, offs, row_bytes, mask, QTYPE)
        tl.store(out_ptr + i.to(tl.int64) * K + offs, w, mask=mask)


def available() -> str | None:
    """None when the kernels can run (on CUDA, or anywhere under TRITON_INTERPRET=1), else why not."""
    return None if triton is not None else "triton is not installed"


def matmul(x: torch.Tensor, segments: list[tuple[torch.Tensor, int]], K: int, N: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T + bias in x's dtype, W the row segments [(packed uint8 [rows, row_bytes], GGML
    type id)] one after another; rows past them (a vocabulary-parallel head's padding) are zero weights."""
    M = x.shape[0]
    x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32
    first = 0
    for data, qtype in segments:
        rows = data.shape[0]
        out = y[:, first:first + rows]
        grid = (triton.cdiv(M, block_m), triton.cdiv(rows, 64))
        _gguf_matmul_kernel[grid](x, data, out, M, rows, K, data.shape[1], x.stride(0), y.stride(0),
                                  QTYPE=qtype, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                  BLOCK_M=block_m, BLOCK_N=64)
        first += rows
    if first < N:
        y[:, first:] = 0
    return y if bias is None else y.add_(bias)


def dequantize_rows(data: torch.Tensor, qtype: int, K: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [len(ids), K]: rows `ids` (default: all) of the packed matrix, dequantized."""
    if ids is None:
        ids = torch.arange(data.shape[0], device=data.device)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), K, dtype=torch.float32, device=data.device)
    if ids.numel():
        block = 256
        _gguf_dequantize_kernel[(ids.numel(), triton.cdiv(K, block))](data, ids, out, K, data.shape[1], QTYPE=qtype,
                                                                      BLOCK=block)
    return out
