"""Small-M linear layers on CPU: the weight stream of a low-batch decode step (C++ in csrc/cpu_small_gemm.cpp).

At a handful of rows a linear layer reads every weight once and does little arithmetic with it, so its speed is
the memory bandwidth it sustains. torch's float32 path (MKL) and oneDNN's prepacked bfloat16 GEMM are built for
large M; this kernel streams the plain [out, in] weight row block by row block over the OpenMP threads and keeps
the few activation rows in L1 (float32 accumulation, as oneDNN's bfloat16 GEMM). PackedMatmul sends a matmul here
when it has at most MAX_ROWS rows, the weight is dense float32 or bfloat16 on CPU, and the kernel built;
otherwise (prefill, larger batches, quantized weights, no compiler) torch/oneDNN run as before.

The kernel is compiled on first use for this process's CPU tier (execution/native_build.py): AVX-512F, AVX2+FMA,
or a portable loop. SHOAL_DISABLE_SMALL_GEMM=1 keeps every matmul on torch's path (for comparisons).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the kernel is at least as fast as torch's path: one thread streaming 30 layers of SmolLM2's
# shapes, float32 1.0-1.8x MKL up to 32 rows (0.95x at 64); bfloat16 1.6x oneDNN's prepacked GEMM at 1 row, 1.4x
# at 4, 1.0x at 16, 0.97x at 32 (and 1.1x a plain bfloat16 F.linear there).
MAX_ROWS = 32


@functools.cache
def load_kernel():
    """torch.ops.shoal_cpu_gemm.linear, or None (disabled, or it could not be built: the caller uses torch)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    if os.environ.get("SHOAL_DISABLE_SMALL_GEMM") == "1":
        return None
    try:
        return kernel_ops("small_gemm").linear
    except NativeBuildError as e:  # never fatal: torch's matmul runs
        logger.warning("%s; small-batch linear layers use torch's matmul", e)
        return None


def kernel_for(weight: torch.Tensor):
    """The small-M kernel for matmuls with this weight (dense float32/bfloat16 [out, in] on CPU), or None."""
    if (weight.device.type != "cpu" or weight.dtype not in DTYPES or weight.dim() != 2 or not weight.numel()
            or not weight.is_contiguous()):
        return None
    return load_kernel()


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T is a step the kernel takes (a few contiguous rows in the weight's dtype)."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype and x.stride(1) == 1
