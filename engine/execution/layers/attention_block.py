"""Self-attention with rotary positions, the attention of every rotary decoder family, as one module: fused QKV
projection, optional q/k norm and clipping, RoPE in place, paged attention (optionally windowed, soft-capped, with
attention sinks), output projection (row-parallel, one all-reduce).

q/k norm comes in two shapes: per head over head_dim with one weight shared by all heads (Qwen3, Qwen3-MoE, Gemma 3
with Gemma's (1 + w) norm), and over the whole projection (OLMoE: q_norm over num_heads * head_dim, k_norm over
num_kv_heads * head_dim). The second spans every tensor-parallel rank's heads, so its mean of squares is summed over
the group (one small all-reduce of [tokens, 2] values); key heads replicated on several ranks (fewer KV heads than
ranks) are counted once.

Checkpoints keep q, k and v apart (q_proj, k_proj, v_proj) or fused into one tensor (Phi-3's qkv_proj); `load`
reads either, each tensor-parallel rank only its rows of each part.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.fused import add_rms_norm
from shoal.engine.execution.layers.linear import QKVParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import fused_readers, reader

QK_NORMS = (None, "head", "full")


class RotaryAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype, backend, rotary: RotaryEmbedding, head_dim: int, *,
                 scale: float | None = None, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: str | None = None, norm_cls: type[nn.Module] = RMSNorm, clip_qkv: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, sinks: bool = False):
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
                                   scale or head_dim ** -0.5, sliding_window=sliding_window, softcap=softcap,
                                   sinks=sinks)
        self.qk_norm, self.clip_qkv = qk_norm, clip_qkv
        self.q_norm = self.k_norm = None
        if qk_norm == "head":
            self.q_norm, self.k_norm = norm_cls(head_dim, self.eps, dtype), norm_cls(head_dim, self.eps, dtype)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.qkv_proj.q_size, self.eps, dtype)
            self.k_norm = RMSNorm(self.qkv_proj.kv_size, self.eps, dtype)

    def _norm_qk_(self, qkv: torch.Tensor) -> None:
        T, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        if self.qk_norm == "head":
            q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(T, q_size))
            k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(T, kv_size))
            return
        ps = self.o_proj.ps
        if ps.tp_size == 1:
            q.copy_(self.q_norm(q.contiguous()))
            k.copy_(self.k_norm(k.contiguous()))
            return
        qf, kf = q.float(), k.float()
        sq = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)
        ps.all_reduce(sq)
        kv_replicas = max(1, ps.tp_size // self.total_kv_heads)  # ranks holding each key head
        mean_q = sq[:, 0:1] / (self.total_heads * self.head_dim)
        mean_k = sq[:, 1:2] / (kv_replicas * self.total_kv_heads * self.head_dim)
        q.copy_(self.q_norm.weight * (qf * torch.rsqrt(mean_q + self.eps)).to(q.dtype))
        k.copy_(self.k_norm.weight * (kf * torch.rsqrt(mean_k + self.eps)).to(k.dtype))

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
        """Weights under the prefix `a` (e.g. 'model.layers.3.self_attn.'): {q,k,v}_proj or a fused qkv_proj, o_proj,
        their biases where the layer has them, q_norm/k_norm, and the sinks of this rank's heads."""
        h, hd, nh, nkv = self.hidden, self.head_dim, self.total_heads, self.total_kv_heads
        rows = {"q": nh * hd, "k": nkv * hd, "v": nkv * hd}
        has_bias = self.qkv_proj.bias is not None
        if src.has(a + "qkv_proj.weight"):  # Phi-3: [q | k | v] in one tensor
            parts = list(rows.values())
            weights = fused_readers(src, a + "qkv_proj.weight", parts, h)
            biases = fused_readers(src, a + "qkv_proj.bias", parts) if has_bias else None
        else:
            weights = [reader(src, f"{a}{n}_proj.weight", (rows[n], h)) for n in "qkv"]
            biases = [reader(src, f"{a}{n}_proj.bias", (rows[n],)) for n in "qkv"] if has_bias else None
        self.qkv_proj.load(weights, biases)
        self.o_proj.load(reader(src, a + "o_proj.weight", (h, nh * hd)),
                         reader(src, a + "o_proj.bias", (h,)) if self.o_proj.bias is not None else None)
        if self.attn.sinks is not None:
            heads = self.attn.num_heads
            self.attn.sinks.data.copy_(src.load(a + "sinks", (nh,), dim=0, start=self.qkv_proj.q_start // hd,
                                                length=heads))
        if self.qk_norm == "head":
            self.q_norm.weight.data.copy_(src.load(a + "q_norm.weight", (hd,)))
            self.k_norm.weight.data.copy_(src.load(a + "k_norm.weight", (hd,)))
        elif self.qk_norm == "full":
            # The slices this rank's heads use: the same ranges its fused projection took (QKVParallelLinear).
            (_, q_start, q_n), (_, kv_start, kv_n), _ = self.qkv_proj._ranges()
            self.q_norm.weight.data.copy_(src.load(a + "q_norm.weight", (nh * hd,), dim=0, start=q_start, length=q_n))
            self.k_norm.weight.data.copy_(src.load(a + "k_norm.weight", (nkv * hd,), dim=0, start=kv_start,
                                                   length=kv_n))
