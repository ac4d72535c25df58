"""Self-attention with rotary positions as one module: fused QKV projection, optional RMSNorm of the queries and
keys (before RoPE), RoPE in place, paged attention, output projection (row-parallel, one all-reduce).

q/k norm comes in two shapes: per head over head_dim with one weight shared by all heads (Qwen3, Qwen3-MoE), and
over the whole projection (OLMoE: q_norm over num_heads * head_dim, k_norm over num_kv_heads * head_dim). The
second spans every tensor-parallel rank's heads, so its mean of squares is summed over the group (one small
all-reduce of [tokens, 2] values); key heads replicated on several ranks (fewer KV heads than ranks) are counted
once.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.fused import add_rms_norm
from shoal.engine.execution.layers.linear import QKVParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import reader

QK_NORMS = (None, "head", "full")


class RotaryAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype, backend, rotary: RotaryEmbedding, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: str | None = None,
                 clip_qkv: float | None = None):
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {qk_norm!r} must be one of {QK_NORMS}")
        h, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.hidden, self.head_dim, self.total_heads, self.total_kv_heads = h, head_dim, nh, nkv
        self.eps = config.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(h, head_dim, nh, nkv, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(nh * head_dim, h, o_bias, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(backend, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                                   head_dim ** -0.5)
        self.qk_norm, self.clip_qkv = qk_norm, clip_qkv
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        norm_sizes = {None: (0, 0), "head": (head_dim, head_dim), "full": (q_size, kv_size)}[qk_norm]
        self.q_norm = nn.Parameter(torch.ones(norm_sizes[0], dtype=dtype), requires_grad=False)
        self.k_norm = nn.Parameter(torch.ones(norm_sizes[1], dtype=dtype), requires_grad=False)

    def _norm_qk_(self, qkv: torch.Tensor) -> None:
        T, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        if self.qk_norm == "head":
            q.copy_(add_rms_norm(q.reshape(-1, self.head_dim), None, self.q_norm, self.eps).view(T, q_size))
            k.copy_(add_rms_norm(k.reshape(-1, self.head_dim), None, self.k_norm, self.eps).view(T, kv_size))
            return
        ps = self.o_proj.ps
        if ps.tp_size == 1:
            q.copy_(add_rms_norm(q.contiguous(), None, self.q_norm, self.eps))
            k.copy_(add_rms_norm(k.contiguous(), None, self.k_norm, self.eps))
            return
        qf, kf = q.float(), k.float()
        sq = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)
        ps.all_reduce(sq)
        kv_replicas = max(1, ps.tp_size // self.total_kv_heads)  # ranks holding each key head
        mean_q = sq[:, 0:1] / (self.total_heads * self.head_dim)
        mean_k = sq[:, 1:2] / (kv_replicas * self.total_kv_heads * self.head_dim)
        q.copy_(self.q_norm * (qf * torch.rsqrt(mean_q + self.eps)).to(q.dtype))
        k.copy_(self.k_norm * (kf * torch.rsqrt(mean_k + self.eps)).to(k.dtype))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        qkv = self.qkv_proj.matmul(h, self.qkv_proj.bias)
        if self.qk_norm is not None:
            self._norm_qk_(qkv)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Queries and keys sit side by side in the fused projection: rotate both in place in one pass.
        self.rotary.rotate_(positions, qkv, self.attn.num_heads + self.attn.num_kv_heads)
        q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def load(self, src, a: str) -> None:
        """Weights under the prefix `a` (e.g. 'model.layers.3.self_attn.'): {q,k,v,o}_proj and q_norm/k_norm."""
        h, hd, nh, nkv = self.hidden, self.head_dim, self.total_heads, self.total_kv_heads
        shapes = {"q": (nh * hd, h), "k": (nkv * hd, h), "v": (nkv * hd, h)}
        self.qkv_proj.load(
            [reader(src, f"{a}{n}_proj.weight", shapes[n]) for n in "qkv"],
            [reader(src, f"{a}{n}_proj.bias", shapes[n][:1]) for n in "qkv"] if self.qkv_proj.bias is not None else None,
        )
        self.o_proj.load(reader(src, a + "o_proj.weight", (h, nh * hd)),
                         reader(src, a + "o_proj.bias", (h,)) if self.o_proj.bias is not None else None)
        if self.qk_norm == "head":
            self.q_norm.data.copy_(src.load(a + "q_norm.weight", (hd,)))
            self.k_norm.data.copy_(src.load(a + "k_norm.weight", (hd,)))
        elif self.qk_norm == "full":
            # The slices this rank's heads use: the same ranges its fused projection took (QKVParallelLinear).
            (_, q_start, q_n), (_, kv_start, kv_n), _ = self.qkv_proj._ranges()
            self.q_norm.data.copy_(src.load(a + "q_norm.weight", (nh * hd,), dim=0, start=q_start, length=q_n))
            self.k_norm.data.copy_(src.load(a + "k_norm.weight", (nkv * hd,), dim=0, start=kv_start, length=kv_n))
