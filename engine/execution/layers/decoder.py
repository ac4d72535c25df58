"""The two halves of a decoder layer that most families share: self-attention over the paged cache, and a gated
MLP. Families differ in what surrounds them (norm placement, residual scaling), which stays in each model module.

Checkpoints store the projections either separately (q_proj, k_proj, v_proj; gate_proj, up_proj) or fused
(Phi-3's qkv_proj and gate_up_proj): `fused_readers` turns one fused tensor into per-part readers, so a
tensor-parallel rank still reads only its own rows of each part.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.activation import act_and_mul
from shoal.engine.execution.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, Reader,
                                                  RowParallelLinear)
from shoal.engine.execution.layers.rotary import RotaryEmbedding


def fused_readers(src, name: str, part_rows: list[int], cols: int) -> list[Reader]:
    """Readers over the row blocks of one checkpoint tensor [sum(part_rows), cols] that fuses several projections
    along its output dimension: reader i sees rows [offset_i, offset_i + part_rows[i]) as a whole tensor."""
    full = (sum(part_rows), cols)
    readers, offset = [], 0
    for rows in part_rows:
        def read(dim: int, start: int, length: int, base: int = offset, rows: int = rows) -> torch.Tensor:
            if dim == 0:
                return src.load(name, full, dim=0, start=base + start, length=length)
            return src.load(name, full, dim=0, start=base, length=rows)[:, start:start + length]

        readers.append(read)
        offset += rows
    return readers


class SelfAttention(nn.Module):
    """qkv projection, optional per-head q/k norm, RoPE, paged attention (optionally windowed and soft-capped),
    output projection."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 backend, rotary: RotaryEmbedding, scale: float, bias: bool = False,
                 sliding_window: int | None = None, softcap: float | None = None,
                 qk_norm: tuple[nn.Module, nn.Module] | None = None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, False, dtype)
        self.rotary = rotary
        self.head_dim = head_dim
        self.attn = PagedAttention(backend, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, scale,
                                   sliding_window=sliding_window, softcap=softcap)
        self.q_norm, self.k_norm = qk_norm if qk_norm is not None else (None, None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        qkv = self.qkv_proj.matmul(x, self.qkv_proj.bias)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        heads, kv_heads, T = self.attn.num_heads, self.attn.num_kv_heads, qkv.shape[0]
        if self.q_norm is not None:  # per-head RMSNorm of queries and keys, before RoPE (Gemma 3)
            q = qkv[:, :q_size].view(T, heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(T, kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        self.rotary.rotate_(positions, qkv, heads + kv_heads)
        q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def load(self, qkv: list[Reader], o: Reader, qkv_bias: list[Reader] | None = None) -> None:
        self.qkv_proj.load(qkv, qkv_bias if self.qkv_proj.bias is not None else None)
        self.o_proj.load(o)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one merged column-parallel matmul."""

    def __init__(self, hidden: int, intermediate: int, activation: str, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)
        self.act_and_mul = act_and_mul(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def load(self, gate_up: list[Reader], down: Reader) -> None:
        self.gate_up_proj.load(gate_up)
        self.down_proj.load(down)
