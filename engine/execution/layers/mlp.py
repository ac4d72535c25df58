"""The SwiGLU MLP (gate and up merged into one column-parallel matmul, down row-parallel) as one module."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.fused import silu_and_mul
from shoal.engine.execution.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's share of the output, before the all-reduce (and without down's bias)."""
        return self.down_proj.matmul(silu_and_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def load(self, read_gate, read_up, read_down, bias_readers=None) -> None:
        """Readers (layers.linear) for the gate, up and down weights; bias_readers likewise when bias=True."""
        b = bias_readers or (None, None, None)
        self.gate_up_proj.load([read_gate, read_up], [b[0], b[1]] if self.gate_up_proj.bias is not None else None)
        self.down_proj.load(read_down, b[2])
