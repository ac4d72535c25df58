"""Normalisation layers, computed in float32 like the reference implementations (RMSNorm: see layers.fused)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.execution.layers.fused import add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """norm(residual + delta), adding delta into the residual stream in place (one fused kernel on CPU)."""
        return add_rms_norm(residual, delta, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w and the scale is (1 + w), applied in float32 before rounding back
    to the input's dtype (Llama rounds first, then scales)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps, unit_offset=True)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """norm(residual + delta), adding delta into the residual stream in place (as RMSNorm.add_and_norm)."""
        return add_rms_norm(residual, delta, self.weight, self.eps, unit_offset=True)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
