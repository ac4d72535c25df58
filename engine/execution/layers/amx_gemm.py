"""bfloat16 and int8 (W8A8) linear layers on Intel AMX tiles (C++ in csrc/cpu_amx_gemm.cpp), for every batch size,
from one copy of the weight in the tiles' layout.

On an AMX CPU the small-M vector kernel (small_gemm.py) and oneDNN's prepacked GEMM each lose one regime: the
vector kernel is compute-bound from a few rows on (6-8x slower than tiles at 32 rows: a decode batch), and oneDNN
pays ~15-20 us of call overhead per matmul (2x slower at one row on the bench model's shapes) and needs its own
blocked copy. This kernel keeps one copy in the pair layout, runs tile products from two rows on and AVX512-BF16
broadcasts at one, and matches or beats both from batch 1 to 128 (docs/performance.md); at prompt-sized batches it
is within ~10-20 % of oneDNN either way, with half oneDNN's weight memory.

int8 (W8A8, quantization/int8.py's Int8Weight): the int8 weight in the same 1 KiB blocks, four bytes per lane
(quads), activations quantized per token inside the call, TDPBSSD's exact int32 sums scaled back in the epilogue;
for out % 16 == 0 and in % 64 == 0.

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
    """[..., N, K] -> the tiles' layout, leading dimensions (a stack of experts) kept. bfloat16: [..., N/16, K/32,
    16, 32], per block of 16 outputs x 32 inputs p[kp][n][j] = w[n][2 kp + j] (pairs); int8: [..., N/16, K/64, 16,
    64], p[kq][n][j] = w[n][4 kq + j] (quads). Either way a block is 1 KiB: 16 rows of 64 bytes."""
    *lead, n, k = weight.shape
    group = 4 // weight.element_size()  # inputs per 32-bit lane of a tile row
    depth = BLOCK_N * group  # inputs per block
    d = len(lead)
    blocks = weight.reshape(*lead, n // BLOCK_N, BLOCK_N, k // depth, BLOCK_N, group)
    return (blocks.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).contiguous()
            .view(*lead, n // BLOCK_N, k // depth, BLOCK_N, depth))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the [..., N, K] weight."""
    *lead, nb, kb, _, depth = packed.shape
    group = depth // BLOCK_N
    d = len(lead)
    lanes = packed.view(*lead, nb, kb, BLOCK_N, BLOCK_N, group)
    return (lanes.permute(*range(d), d, d + 3, d + 1, d + 2, d + 4)
            .reshape(*lead, nb * BLOCK_N, kb * depth))


def int8_kernel_for(q: torch.Tensor):
    """The AMX kernel's ops for W8A8 matmuls with this int8 weight [out, in] (on CPU, out % 16 == 0, in % 64 == 0),
    or None."""
    if (q.device.type != "cpu" or q.dtype != torch.int8 or q.dim() != 2 or not q.numel()
            or q.shape[0] % BLOCK_N or q.shape[1] % (4 * BLOCK_N)):
        return None
    return load_kernel()
