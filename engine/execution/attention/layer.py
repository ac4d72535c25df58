"""The attention step every model layer shares: store new keys/values, then attend over the paged cache.

A step whose images attend bidirectionally (Gemma 3: meta.image_spans) runs every layer through SDPA with the
explicit mask (causal, or the same image; each layer's window kept): the paged kernels are causal only. Steps
without spans (text, decode, other families) keep the configured backend and its captured decode graphs."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.base import AttentionBackend, AttentionMetadata, KVCache


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: bool = False):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens (got {sliding_window})")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"attention logit soft-capping must be positive (got {softcap})")
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window or None
        self.softcap = softcap or None
        # gpt-oss: one learned softmax-denominator logit per (local) query head, loaded with the layer's weights.
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        kv_cache.write(k, v, meta.slot_mapping)
        backend = self.backend if meta.image_spans is None or self.backend.name == "sdpa" else _masked()
        out = backend.forward(q, kv_cache.k, kv_cache.v, meta, self.scale, self.alibi_slopes,
                                   k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale,
                                   sliding_window=self.sliding_window, softcap=self.softcap, sinks=self.sinks)
        return out.reshape(T, self.num_heads * self.head_dim)


_MASKED: list[AttentionBackend] = []


def _masked() -> AttentionBackend:
    """The SDPA backend (one instance: it keeps no state beyond a step's scratch), for steps with image spans."""
    if not _MASKED:
        from shoal.engine.execution.attention.sdpa import SdpaBackend

        _MASKED.append(SdpaBackend())
    return _MASKED[0]
