"""The depthwise causal conv1d (plus SiLU) in front of every recurrent layer (Gated DeltaNet, Mamba, Mamba2), over
one sequence's prompt chunk or one decode token of many, continuing from the last K-1 inputs each sequence keeps in
its state slot (`state.conv` [slots, channels, K-1], see RecurrentState)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_chunk(x: torch.Tensor, state, slot: int, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """One sequence's chunk x [n, channels] through the depthwise causal conv (weight [channels, K]) and SiLU,
    continuing from (and updating) the conv state of its slot."""
    k = weight.shape[1]
    window = torch.cat([state.conv[slot], x.t()], dim=-1)  # [channels, K - 1 + n]
    state.conv[slot] = window[:, window.shape[1] - (k - 1):]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None], bias, groups=weight.shape[0])
    return F.silu(out[0].t()).to(x.dtype)


def causal_conv_step(x: torch.Tensor, state, slots: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """One token of each sequence, x [S, channels], through the causal conv and SiLU (float32 sums, x's dtype out),
    shifting each sequence's conv state."""
    window = torch.cat([state.conv[slots], x[:, :, None]], dim=-1)  # [S, channels, K]
    state.conv[slots] = window[:, :, 1:]
    conv = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        conv = conv + bias.float()
    return F.silu(conv).to(x.dtype)
