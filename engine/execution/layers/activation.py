"""Activation functions by the names Hugging Face configs use."""

from __future__ import annotations

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
    for silu (the fused kernel), GeGLU for the gelu variants."""
    if name in ("silu", "swish"):
        from shoal.engine.execution.layers.fused import silu_and_mul

        return silu_and_mul
    act = get_activation(name)

    def gated(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return gated
