"""The decoder-only transformer most 2024-2026 families share, as a base to subclass: token embedding, layers of
(RMSNorm, rotary self-attention, RMSNorm, MLP) with pre-norm residuals, final RMSNorm, tied or untied LM head.

A family says what differs through class attributes (q/k norm, QKV bias) and two hooks: `make_mlp` (a dense
GatedMLP, a SparseMoeBlock, ...) and `load_mlp` (where its checkpoint keeps that MLP's tensors). Each layer's
residual add is deferred into the next layer's first norm (one fused add + RMSNorm kernel on CPU), as in llama.py.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.mlp import GatedMLP
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: RotaryAttention, mlp: nn.Module, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = mlp

    def forward(self, x, positions, kv_cache, meta, delta=None):
        """x: the residual stream, updated in place; delta: the previous layer's output, not yet added to it.
        Returns (x, this layer's output)."""
        attn_out = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, kv_cache, meta)
        return x, self.mlp(self.post_attention_layernorm.add_and_norm(x, attn_out))


class RotaryDecoderLM(CausalLM):
    qk_norm: str | None = None  # None, "head" (per head over head_dim) or "full" (over the whole projection)

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"{type(self).__name__}: hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        start, end = self.stage_layers(config.num_hidden_layers, layer_partition)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   materialize=first or (last and tied))
        self.rotary = RotaryEmbedding(config, self.head_dim, max_model_len, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(self.make_attention(dtype, backend), self.make_mlp(i, dtype), config.hidden_size,
                         config.rms_norm_eps, dtype)
            for i in range(start, end)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=tied, materialize=last)
        self.num_kv_heads_local = self.layers[0].self_attn.qkv_proj.num_kv_heads if len(self.layers) else 0

    # ---- what a family overrides
    def make_attention(self, dtype, backend) -> RotaryAttention:
        c = self.config
        return RotaryAttention(c, dtype, backend, self.rotary, self.head_dim,
                               qkv_bias=bool(getattr(c, "attention_bias", False)),
                               o_bias=bool(getattr(c, "attention_bias", False)), qk_norm=self.qk_norm,
                               clip_qkv=getattr(c, "clip_qkv", None))

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size, dtype)

    def load_mlp(self, mlp: nn.Module, src, p: str, layer_idx: int) -> None:
        """Load layer `layer_idx`'s MLP from the tensors under the layer prefix `p`."""
        load_dense_mlp(mlp, src, p + "mlp.")

    # ---- the shared skeleton
    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        # The residual stream is updated in place: a stage's input from the previous stage is copied first.
        x = self.embed(input_ids, positions) if self.ps.is_first_stage else hidden.clone()
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, positions, kv_caches[i], meta, delta)
        if self.ps.is_last_stage:
            return self.norm.add_and_norm(x, delta)
        return x if delta is None else x.add_(delta)

    def final_norm(self, hidden):
        return self.norm(hidden)

    def load_weights(self, src) -> None:
        c = self.config
        p = find_prefix(src, ["model.", ""], "norm.weight")
        shape = (c.vocab_size, c.hidden_size)
        if self.ps.is_first_stage or (self.ps.is_last_stage and self.lm_head.tied):
            self.embed_tokens.load(reader(src, p + "embed_tokens.weight", shape))
        for i, layer in enumerate(self.layers):
            idx = self.start_layer + i
            lp = f"{p}layers.{idx}."
            layer.input_layernorm.weight.data.copy_(src.load(lp + "input_layernorm.weight", (c.hidden_size,)))
            layer.post_attention_layernorm.weight.data.copy_(
                src.load(lp + "post_attention_layernorm.weight", (c.hidden_size,)))
            layer.self_attn.load(src, lp + "self_attn.")
            self.load_mlp(layer.mlp, src, lp, idx)
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + "norm.weight", (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))


def load_dense_mlp(mlp: GatedMLP, src, m: str, names=("gate_proj", "up_proj", "down_proj")) -> None:
    h, inter = mlp.hidden, mlp.intermediate
    gate, up, down = (f"{m}{n}.weight" for n in names)
    mlp.load(reader(src, gate, (inter, h)), reader(src, up, (inter, h)), reader(src, down, (h, inter)))
