"""Qwen3NextForCausalLM: Gated DeltaNet layers mixed with gated full attention (3:1 by default), MoE with a shared
expert, zero-centred RMSNorm.

- Layer types from config.layer_types ("linear_attention" / "full_attention"); anything else is refused at load.
- Linear layers: layers/gated_delta_net.py, their state in the hybrid caches (models/hybrid.py).
- Full attention: q_proj yields, per head, the query and an output gate side by side ([heads, 2, head_dim]); the
  attention output is multiplied by sigmoid(gate) before o_proj. Per-head q/k RMSNorm and every other norm are
  zero-centred ((1 + w) in float32, GemmaRMSNorm); RoPE is partial (partial_rotary_factor, 0.25 in the releases).
- MLP: Qwen2-MoE's sparse block (softmax top-k, renormalised by norm_topk_prob; a shared expert gated by
  sigmoid(shared_expert_gate . x)), dense where mlp_only_layers / decoder_sparse_step say so.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.gated_delta_net import GatedDeltaNet
from shoal.engine.execution.layers.linear import ColumnParallelLinear
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.layers.norm import GemmaRMSNorm
from shoal.engine.execution.models.base import reader, tensor_reader
from shoal.engine.execution.models.decoder import FULL
from shoal.engine.execution.models.hybrid import HybridCaches
from shoal.engine.execution.models.moe import _SparseDecoderLM

LINEAR = "linear_attention"


class GatedAttention(RotaryAttention):
    """RotaryAttention whose output is gated per channel by sigmoid of a second half of q_proj."""

    def __init__(self, config, dtype, backend, rotary, head_dim, **options):
        super().__init__(config, dtype, backend, rotary, head_dim, **options)
        self.gate_proj = ColumnParallelLinear(self.hidden, self.total_heads * head_dim, False, dtype)

    def forward(self, h, positions, kv_cache, meta):
        qkv = self.qkv_proj.matmul(h, self.qkv_proj.bias)
        self._norm_qk_(qkv)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary.rotate_(positions, qkv, self.attn.num_heads + self.attn.num_kv_heads)
        q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(h)))

    def load(self, src, a: str) -> None:
        h, hd, nh, nkv = self.hidden, self.head_dim, self.total_heads, self.total_kv_heads
        # [heads * (query | gate), hidden]: de-interleave into the query rows and the gate rows.
        both = src.load(a + "q_proj.weight", (nh * 2 * hd, h)).view(nh, 2, hd, h)
        query, gate = (tensor_reader(both[:, i].reshape(nh * hd, h)) for i in (0, 1))
        self.qkv_proj.load([query, reader(src, a + "k_proj.weight", (nkv * hd, h)),
                            reader(src, a + "v_proj.weight", (nkv * hd, h))])
        self.gate_proj.load(gate)
        self.o_proj.load(reader(src, a + "o_proj.weight", (h, nh * hd)))
        self.q_norm.weight.data.copy_(src.load(a + "q_norm.weight", (hd,)))
        self.k_norm.weight.data.copy_(src.load(a + "k_norm.weight", (hd,)))


class Qwen3NextForCausalLM(HybridCaches, _SparseDecoderLM):
    norm_cls = GemmaRMSNorm
    qk_norm = "head"
    family = "Qwen3-Next"  # in load errors
    linear_mixer_cls = GatedDeltaNet  # the linear layers' mixer (Qwen3.5 reads its projections another way)

    def __init__(self, config, dtype, backend, max_model_len, layer_partition=None):
        if getattr(config, "attention_bias", False):
            raise ValueError(f"{self.family} config: attention_bias=true is not supported (the releases have none)")
        super().__init__(config, dtype, backend, max_model_len, layer_partition)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown or len(types) != config.num_hidden_layers:
            raise ValueError(f"{cls.family} config: layer_types {types} must give {LINEAR!r} or {FULL!r} for each of "
                             f"the {config.num_hidden_layers} layers (num_hidden_layers)"
                             + (f"; unsupported layer type(s) {unknown}" if unknown else ""))
        return types

    def make_mixer(self, layer_idx, layer_type, window, rotaries, dtype, backend) -> nn.Module:
        if layer_type == LINEAR:
            return self.linear_mixer_cls(self.config, dtype)
        return GatedAttention(self.config, dtype, backend, rotaries[FULL], self.head_dim, qk_norm="head",
                              norm_cls=GemmaRMSNorm)

    def mixer_prefix(self, layer_idx: int) -> str:
        return "linear_attn." if self.layer_types(self.config)[layer_idx] == LINEAR else "self_attn."

    def moe_block(self, dtype, **shared) -> SparseMoeBlock:
        c = self.config
        return super().moe_block(dtype, shared_intermediate=c.shared_expert_intermediate_size, shared_gate=True)
