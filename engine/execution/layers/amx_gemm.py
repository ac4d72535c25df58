"""bfloat16 linear layers on Intel AMX tiles (C++ in csrc/cpu_amx_gemm.cpp), for every batch size, from one copy of
the weight in the tiles' pair layout.

On an AMX CPU the small-M vector kernel (small_gemm.py) and oneDNN's prepacked GEMM each lose one regime: the
vector kernel is compute-bound from a few rows on (6-8x slower than tiles at 32 rows: a decode batch), and oneDNN
pays ~15-20 us of call overhead per matmul (2x slower at one row on the bench model's shapes) and needs its own
blocked copy. This kernel keeps one copy in the pair layout, runs tile products from two rows on and AVX512-BF16
broadcasts at one, and matches or beats both from batch 1 to 128 (docs/performance.md); at prompt-sized batches it
is within ~10-20 % of oneDNN either way, with half oneDNN's weight memory.

Chosen only at the AMX tier (not when SHOAL_CPU_ISA caps it lower), for bfloat16 weights whose output features
are a multiple of 16 and input features a multiple of 32 (every layer of the families served; others keep the
small-M kernel or oneDNN). SHOAL_DISABLE_AMX=1 turns it off (for comparisons).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from shoal.engine.execution.cpu_features import cpu_features

logger = logging.getLogger(__name__)

BLOCK_N, BLOCK_K = 16, 32  # output x input features of one 1 KiB weight block


@functools.cache
def load_kernel():
    """torch.ops.shoal_cpu_amx, or None (not an AMX tier, disabled, not buildable, or the OS refused the tiles)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    if os.environ.get("SHOAL_DISABLE_AMX") == "1" or cpu_features().tier != "amx":
        return None
    try:
        ops = kernel_ops("amx_gemm")
    except NativeBuildError as e:  # never fatal: the vector kernel or oneDNN runs
        logger.warning("%s; bf16 linear layers do not use AMX tiles", e)
        return None
    if not ops.available():
        logger.warning("the OS did not grant this process AMX tile state; bf16 linear layers do not use the tiles")
        return None
    return ops


def kernel_for(weight: torch.Tensor):
    """The AMX kernel's ops for matmuls with this weight (bfloat16 [out, in] on CPU, out % 16 == 0, in % 32 == 0),
    or None."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.numel()
            or weight.shape[0] % BLOCK_N or weight.shape[1] % BLOCK_K):
        return None
    return load_kernel()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> [..., N/16, K/32, 16, 32]: per block of 16 outputs x 32 inputs, p[kp][n][j] = w[n][2 kp + j]
    (leading dimensions, e.g. a stack of experts, kept)."""
    *lead, n, k = weight.shape
    d = len(lead)
    blocks = weight.reshape(*lead, n // BLOCK_N, BLOCK_N, k // BLOCK_K, BLOCK_K // 2, 2)
    return (blocks.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).contiguous()
            .view(*lead, n // BLOCK_N, k // BLOCK_K, BLOCK_N, BLOCK_K))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the [..., N, K] weight."""
    *lead, nb, kb = packed.shape[:-2]
    d = len(lead)
    pairs = packed.view(*lead, nb, kb, BLOCK_K // 2, BLOCK_N, 2)
    return (pairs.permute(*range(d), d, d + 3, d + 1, d + 2, d + 4)
            .reshape(*lead, nb * BLOCK_N, kb * BLOCK_K))
