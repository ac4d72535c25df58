"""ALiBi slopes (BLOOM): a per-head linear bias on key positions instead of position embeddings."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper, with the interleaved extras for non-power-of-two head counts."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        slopes += [extra_base ** p for p in range(1, 1 + 2 * remaining, 2)]
    return torch.tensor(slopes, dtype=torch.float32)
