"""Rotary position embedding (RoPE) with the scaling types Llama-family configs use.

cos/sin tables are computed once for every position up to max_model_len; each step indexes them by the flat
batch's positions. Frequencies for scaled variants come from transformers' own rope-init functions, so configs
mean exactly what they mean there.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.fused import rotary_

_STATIC_TYPES = {"default", "linear", "llama3", "yarn"}


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: {sorted(_STATIC_TYPES)}); "
                "dynamic/longrope scaling changes with the sequence length and is not implemented"
            )
        scaling = 1.0
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
            inv_freq = inv_freq.float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        half = freqs.shape[-1]
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of chunk, neg and cat.
        self.register_buffer("cos", (torch.cat([freqs, freqs], dim=-1).cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (torch.cat([-freqs, freqs], dim=-1).sin() * scaling).to(dtype), persistent=False)
        self.half = half

    def rotate_(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> None:
        """Rotate, in place, the first `heads` heads (queries, then keys) of each row of a fused QKV projection's
        output [T, (heads + kv_heads) * head_dim] by that token's position (one fused kernel on CPU)."""
        rotary_(qkv, positions, self.cos, self.sin, heads, self.cos.shape[-1])
