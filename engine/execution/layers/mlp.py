"""The gated MLP every decoder family's dense layers share: down(act(gate(x)) * up(x)), gate and up merged into one
column-parallel matmul, down row-parallel (one all-reduce). SwiGLU for silu (the fused kernel), GeGLU for the gelu
variants (Gemma).

Checkpoints keep gate and up apart (gate_proj, up_proj) or fused into one tensor (Phi-3's gate_up_proj); `load`
reads either, each tensor-parallel rank only its rows of each part.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.activation import act_and_mul, get_activation
from shoal.engine.execution.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from shoal.engine.execution.models.base import fused_readers, reader


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, activation: str = "silu",
                 bias: bool = False):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)
        self.act_and_mul = act_and_mul(activation)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's share of the output, before the all-reduce (and without down's bias)."""
        return self.down_proj.matmul(self.act_and_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def load(self, src, m: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        """Weights (and biases, where the layer has them) under the prefix `m` (e.g. 'model.layers.3.mlp.')."""
        h, inter = self.hidden, self.intermediate
        gate, up, down = (m + n for n in names)
        has_bias = self.gate_up_proj.bias is not None
        if src.has(m + "gate_up_proj.weight"):  # Phi-3: [gate | up] in one tensor
            weights = fused_readers(src, m + "gate_up_proj.weight", [inter, inter], h)
            biases = fused_readers(src, m + "gate_up_proj.bias", [inter, inter]) if has_bias else None
        else:
            weights = [reader(src, gate + ".weight", (inter, h)), reader(src, up + ".weight", (inter, h))]
            biases = [reader(src, gate + ".bias", (inter,)), reader(src, up + ".bias", (inter,))] if has_bias else None
        self.gate_up_proj.load(weights, biases)
        self.down_proj.load(reader(src, down + ".weight", (h, inter)),
                            reader(src, down + ".bias", (h,)) if has_bias else None)


class PlainMLP(nn.Module):
    """The ungated MLP: down(act(up(x))) (Nemotron-H's squared-ReLU layers), up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, activation: str, bias: bool = False):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def load(self, src, m: str) -> None:
        h, inter = self.hidden, self.intermediate
        has_bias = self.up_proj.bias is not None
        self.up_proj.load(reader(src, m + "up_proj.weight", (inter, h)),
                          reader(src, m + "up_proj.bias", (inter,)) if has_bias else None)
        self.down_proj.load(reader(src, m + "down_proj.weight", (h, inter)),
                            reader(src, m + "down_proj.bias", (h,)) if has_bias else None)
