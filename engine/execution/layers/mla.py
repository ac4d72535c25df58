"""Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2) over a latent KV cache.

MLA compresses each token's keys and values into one latent c = RMSNorm(W_DKV x) of kv_lora_rank values plus one
shared rotary key k_pe of qk_rope_head_dim values. Per head h, the key is [W_UK[h] c | k_pe] and the value
W_UV[h] c, both up-projected from c by kv_b_proj. The cache keeps only [c | k_pe] per token and layer, one
"head" of kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek V3, against 2 x 128 heads x 192 for full K/V).

Attention runs weight-absorbed, for prefill and decode alike: q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c,
so each head's query becomes [W_UK[h]^T q_nope[h] | q_pe[h]] and attends, as multi-query attention with one key head,
over the cached [c | k_pe] entries, which serve as keys and (their first kv_lora_rank values) as values. The
attention output over the latent is then up-projected once per head by W_UV[h]. Any attention backend runs it
(values = keys; the rope tail of each output row is dropped), so the cache is paged, prefix-cached, preempted and
fp8-quantized (one scale per token) exactly like a full K/V cache.

Queries: q_proj, or with q_lora_rank the low-rank q_b_proj(RMSNorm(q_a_proj x)). RoPE rotates the last
qk_rope_head_dim dims of each query head and k_pe; checkpoints (rope_interleave) keep those dims as interleaved
pairs, which `load` reorders into the half-split layout the shared RoPE tables use (a dot product over the same
permutation of both sides is unchanged). The softmax scale is qk_head_dim^-0.5, times mscale^2 under YaRN with
mscale_all_dim (as transformers computes it).

Tensor parallelism: heads split (q projections, kv_b_proj, o_proj by head), the latent replicated: every rank
projects and caches the whole latent.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.attention.base import FP8_DTYPE, KVCache, write_kv
from shoal.engine.execution.attention.cpu_paged import amx_decode_ops
from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.linear import ColumnParallelLinear, PackedMatmul, RowParallelLinear, _param
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding, rope_parameters
from shoal.engine.execution.models.base import reader
from shoal.engine.execution.quantization.gguf import GGUFPacked

logger = logging.getLogger(__name__)

def amx_decode_op():
    """torch.ops.shoal_cpu_amx_attn.mla_decode where this CPU tier has AMX tiles (bfloat16 decode steps, all heads of
    a sequence in tile products), else None: the attention backend runs MLA as one-head MQA, as on every tier."""
    if os.environ.get("SHOAL_DISABLE_MLA_KERNEL") == "1":
        return None
    ops = amx_decode_ops()
    return None if ops is None else ops.mla_decode


LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with this eps, not rms_norm_eps


@dataclass
class LatentKVCache(KVCache):
    """One layer's latent cache: a single tensor [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] that
    is both `k` and `v` (the same storage), with one float32 scale per token when fp8 (`k_scale` is `v_scale`)."""

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto") -> "LatentKVCache":
        shape = (num_blocks, block_size, 1, head_dim)
        if kv_cache_dtype == "auto":
            latent = torch.zeros(shape, dtype=dtype, device=device)
            return cls(latent, latent)
        if kv_cache_dtype != "fp8":
            raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; the latent cache takes auto or fp8")
        latent = torch.zeros(shape, dtype=FP8_DTYPE, device=device)
        scales = torch.ones(shape[:3], dtype=torch.float32, device=device)
        return cls(latent, latent, scales, scales)

    @staticmethod
    def bytes_per_token_head(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one token's latent (values plus, for fp8, its scale): half of a K/V pair of that width."""
        return KVCache.bytes_per_token_head(head_dim, dtype, kv_cache_dtype) // 2

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.k_scale) if t is not None]

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' latents k [T, 1, head_dim] (v is the same entry and is ignored)."""
        nb, bs, h, d = self.k.shape
        if self.k_scale is None:
            self.k.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(self.k.dtype))
            return
        # The shared fp8 write (one fused C++ call on CPU, which recorded decode graphs can replay) stores the entry
        # as both "k" and "v": the same bytes twice into the one tensor.
        write_kv(k, k, self.k, self.v, slot_mapping, self.k_scale, self.v_scale)


class ReplicatedLinear(PackedMatmul):
    """A projection every tensor-parallel rank holds whole (MLA's down-projections: the latent is replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def load(self, read_weight, read_bias=None) -> None:
        self._put(0, read_weight(0, 0, self.weight.shape[0]))
        if self.bias is not None:
            self.bias.data.copy_(read_bias(0, 0, self.bias.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 where the RoPE is scaled and sets mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


def _deinterleave(rows: torch.Tensor, start: int, width: int, period: int) -> torch.Tensor:
    """rows (a weight's rows or a bias) with each period-long run's slice [start, start + width) reordered from
    interleaved pairs (x0, x1, x2, x3, ...) to halves (x0, x2, ..., x1, x3, ...)."""
    perm = torch.arange(rows.shape[0]).view(-1, period)
    rope = perm[:, start:start + width]
    perm[:, start:start + width] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return rows[perm.reshape(-1)]


def _reordered(read, start: int, width: int, period: int):
    """A Reader whose rows come back de-interleaved (see _deinterleave); row slices must start at a period. A packed
    GGUF weight's rows are whole byte rows (GGUF quantizes each row on its own): they move like float rows."""
    def read_rows(dim: int, first: int, length: int):
        rows = read(dim, first, length)
        if dim != 0:
            raise ValueError("MLA's rotary rows are reordered on load: only row slices can be")
        if isinstance(rows, GGUFPacked):
            return GGUFPacked(_deinterleave(rows.data, start, width, period), rows.qtype, rows.cols)
        return _deinterleave(rows, start, width, period)

    return read_rows


class LatentAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype, backend, rotary: RotaryEmbedding):
        super().__init__()
        c = config
        ps = get_parallel_state()
        self.hidden, self.total_heads = c.hidden_size, c.num_attention_heads
        self.num_heads = divide(c.num_attention_heads, ps.tp_size, "number of attention heads")
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rank = c.kv_lora_rank
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        self.interleaved = bool(getattr(c, "rope_interleave", True))
        bias = bool(getattr(c, "attention_bias", False))
        h, nh, qk = c.hidden_size, c.num_attention_heads, self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, nh * qk, False, dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, nh * qk, False, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        # kv_b_proj's rows of this rank's heads, [heads * (nope + v), rank]: never run as a linear layer, only read
        # as W_UK (absorbed into the queries) and W_UV (applied to the attention output over the latent).
        self.kv_b = _param(self.num_heads * (self.nope + self.v_dim), self.rank, dtype=dtype)
        self.o_proj = RowParallelLinear(nh * self.v_dim, h, bias, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(backend, self.num_heads, 1, self.rank + self.rope, softmax_scale(c))

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE (half-split layout) of x [T, ..., rope] by each row's position."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        cos = self.rotary.cos[positions].view(shape)
        sin = self.rotary.sin[positions].view(shape)
        return x * cos + torch.roll(x, self.rotary.half, dims=-1) * sin

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: LatentKVCache, meta) -> torch.Tensor:
        T, H, r = h.shape[0], self.num_heads, self.rank
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        else:
            q = self.q_proj(h)
        q = q.view(T, H, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(h)
        entry = torch.cat([self.kv_a_layernorm(latent[:, :r].contiguous()),
                           self._rotate(latent[:, r:], positions)], dim=-1)
        kv_cache.write(entry.view(T, 1, r + self.rope), None, meta.slot_mapping)
        w = self.kv_b.view(H, self.nope + self.v_dim, r)
        # W_UK absorbed: [H, T, nope] x [H, nope, r] -> [H, T, r], beside the rotated q_pe.
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w[:, :self.nope]).transpose(0, 1)
        query = torch.cat([q_latent, self._rotate(q[..., self.nope:], positions)], dim=-1)
        attn = self.attn
        decode = amx_decode_op() if meta.is_decode_only and kv_cache.k_scale is None and \
            query.dtype == torch.bfloat16 and query.device.type == "cpu" and r % 32 == 0 and \
            query.shape[-1] % 32 == 0 else None
        if decode is not None:  # every head of a sequence in tile products (csrc/cpu_amx_decode_attention.cpp)
            out = query.new_empty(T, H, r)
            decode(out, query, kv_cache.k, meta.block_tables, meta.seq_lens, r, attn.scale)
        else:
            out = attn.backend.forward(query, kv_cache.k, kv_cache.v, meta, attn.scale,
                                       k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale)
        # W_UV: [H, T, r] x [H, r, v] -> [H, T, v]; the rope tail of each output row is not a value.
        o = torch.bmm(out[..., :r].transpose(0, 1), w[:, self.nope:].transpose(1, 2))
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.v_dim))

    def load(self, src, a: str) -> None:
        """Weights under the prefix `a` (e.g. 'model.layers.3.self_attn.'), rotary rows de-interleaved."""
        h, nh, r, qk = self.hidden, self.total_heads, self.rank, self.nope + self.rope
        span = (self.nope, self.rope, qk) if self.interleaved else None

        def rows(read, start, width, period):
            return _reordered(read, start, width, period) if self.interleaved else read

        if self.q_lora_rank:
            q = self.q_lora_rank
            self.q_a_proj.load(reader(src, a + "q_a_proj.weight", (q, h)),
                               reader(src, a + "q_a_proj.bias", (q,)) if self.q_a_proj.bias is not None else None)
            self.q_a_layernorm.weight.data.copy_(src.load(a + "q_a_layernorm.weight", (q,)))
            self.q_b_proj.load(rows(reader(src, a + "q_b_proj.weight", (nh * qk, q)), *span or (0, 0, 0)))
        else:
            self.q_proj.load(rows(reader(src, a + "q_proj.weight", (nh * qk, h)), *span or (0, 0, 0)))
        kv_a = (r, self.rope, r + self.rope)
        self.kv_a_proj_with_mqa.load(
            rows(reader(src, a + "kv_a_proj_with_mqa.weight", (r + self.rope, h)), *kv_a),
            rows(reader(src, a + "kv_a_proj_with_mqa.bias", (r + self.rope,)), *kv_a)
            if self.kv_a_proj_with_mqa.bias is not None else None)
        self.kv_a_layernorm.weight.data.copy_(src.load(a + "kv_a_layernorm.weight", (r,)))
        n = self.kv_b.shape[0]
        start = get_parallel_state().tp_rank * n
        self.kv_b.data.copy_(src.load(a + "kv_b_proj.weight", (nh * (self.nope + self.v_dim), r), dim=0,
                                      start=start, length=n))
        self.o_proj.load(reader(src, a + "o_proj.weight", (h, nh * self.v_dim)),
                         reader(src, a + "o_proj.bias", (h,)) if self.o_proj.bias is not None else None)
