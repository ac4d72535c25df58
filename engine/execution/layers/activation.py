"""Activation functions by the names Hugging Face configs use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Nemotron-H's MLP)
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def act_and_mul(name: str):
    """act(gate) * up for gate_up = [gate | up] along the last dim (a merged gate/up projection's output): SwiGLU
    for silu, GeGLU for the gelu variants (the tanh approximation through the fused kernel too)."""
    if name in ("silu", "swish"):
        from shoal.engine.execution.layers.fused import silu_and_mul

        return silu_and_mul
    if name in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
        from shoal.engine.execution.layers.fused import gelu_tanh_and_mul

        return gelu_tanh_and_mul
    act = get_activation(name)

    def gated(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return gated


@dataclass(frozen=True)
class ExpertActivation:
    """act(gate) * up of the experts: "silu" (SwiGLU), or "swiglu_clamped" (gpt-oss, with its alpha and limit)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    KINDS = ("silu", "swiglu_clamped")  # the C++ kernel's activation ids, in order

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"expert activation {self.kind!r} is not supported (supported: {', '.join(self.KINDS)})")

    @property
    def kernel_id(self) -> int:
        return self.KINDS.index(self.kind)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] (gate columns, then up columns) -> [n, I]."""
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if self.kind == "silu":
            return F.silu(gate).mul_(up)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertActivation()
