"""Rotary position embedding (RoPE) with the scaling types Llama-, Gemma- and Phi-family configs use.

cos/sin tables are computed once for every position up to max_model_len; each step indexes them by the flat
batch's positions. Frequencies for scaled variants come from transformers' own rope-init functions, so configs
mean exactly what they mean there. Models whose layer types use different RoPE (Gemma 3: a local base frequency
for sliding-window layers, scaling for global ones) build one table per layer type (`layer_type`).

LongRoPE (Phi-3 "longrope"/"su"): transformers switches from the short to the long factors once a sequence grows
past original_max_position_embeddings. The choice here is made once, from max_model_len: a server configured for
contexts beyond the original length uses the long factors for every position (what the model was fine-tuned with
for long contexts), one configured within it the short factors. This keeps every position's rotation independent
of the batch and of how far a sequence has got, which the paged cache needs (keys are rotated once, when
written); it equals transformers whenever a sequence's length stays on one side of the threshold.

Partial rotary embedding (`partial_rotary_factor` < 1) rotates only the first rotary_dim dimensions of each head.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.fused import rotary_

_STATIC_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` (of its `layer_type` layers when they differ per type), normalised."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    # "su": LongRoPE's old name; "mrope": Qwen2-VL-era configs' name for default RoPE over 3 position sets
    params["rope_type"] = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: {sorted(_STATIC_TYPES)}); "
                "dynamic scaling changes with the sequence length and is not implemented"
            )
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        rotary_dim = int(head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"partial_rotary_factor {factor} gives rotary dimension {rotary_dim} for head_dim "
                             f"{head_dim}; it must be even and at most head_dim")
        scaling = 1.0
        if rope_type == "default":
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kw = {"layer_type": layer_type} if layer_type is not None else {}
            if rope_type == "longrope":
                original = params.get("original_max_position_embeddings") or getattr(
                    config, "original_max_position_embeddings", None) or config.max_position_embeddings
                kw["seq_len"] = original + 1 if max_positions > original else None
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kw)
            inv_freq = inv_freq.float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        half = freqs.shape[-1]
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of chunk, neg and cat.
        self.register_buffer("cos", (torch.cat([freqs, freqs], dim=-1).cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (torch.cat([-freqs, freqs], dim=-1).sin() * scaling).to(dtype), persistent=False)
        self.half = half
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim

    def rotate_(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> None:
        """Rotate, in place, the first `heads` heads (queries, then keys) of each row of a fused QKV projection's
        output [T, (heads + kv_heads) * head_dim] by that token's position (one fused kernel on CPU)."""
        self._rotate(qkv, positions, self.cos, self.sin, heads)

    def _rotate(self, qkv: torch.Tensor, index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                heads: int) -> None:
        """rotate_ with row i's cos/sin at cos[index[i]], sin[index[i]] (tables [rows, rotary_dim])."""
        if self.rotary_dim == self.head_dim:
            rotary_(qkv, index, cos, sin, heads, self.head_dim)
            return
        x = qkv[:, : heads * self.head_dim].view(qkv.shape[0], heads, self.head_dim)[..., : self.rotary_dim]
        c, s = cos[index].unsqueeze(1), sin[index].unsqueeze(1)
        x.copy_(x * c + torch.roll(x, self.half, dims=-1) * s)
