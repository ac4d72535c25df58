"""Phi3ForCausalLM: a Llama-style pre-norm decoder whose checkpoints fuse the projections.

qkv_proj stores [q | k | v] and gate_up_proj [gate | up] as single tensors; they are split at load time into the
per-head tensor-parallel layout (each rank reads only its rows of each part). RoPE may be LongRoPE ("longrope",
formerly "su": short/long factors and an attention factor, see layers.rotary for when the long factors apply) and
may rotate only part of each head (partial_rotary_factor). A config with sliding_window windows every layer, and
then blocks that slid out of the window are freed.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.decoder import GatedMLP, SelfAttention, fused_readers
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config, dtype, backend, rotary: RotaryEmbedding, head_dim: int, window: int | None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = SelfAttention(h, config.num_attention_heads, config.num_key_value_heads, head_dim, dtype,
                                       backend, rotary, head_dim ** -0.5, sliding_window=window)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, dtype)

    def forward(self, x, positions, kv_cache, meta, delta=None):
        """x: the residual stream, updated in place; delta: the previous layer's output not yet added to it (the
        add fuses with this layer's first norm). Returns (x, this layer's output)."""
        attn = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, kv_cache, meta)
        return x, self.mlp(self.post_attention_layernorm.add_and_norm(x, attn))

    def load(self, src, p: str, config, head_dim: int):
        h, nh, nkv, inter = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, \
            config.intermediate_size
        self.input_layernorm.weight.data.copy_(src.load(p + "input_layernorm.weight", (h,)))
        self.post_attention_layernorm.weight.data.copy_(src.load(p + "post_attention_layernorm.weight", (h,)))
        a, m = p + "self_attn.", p + "mlp."
        self.self_attn.load(fused_readers(src, a + "qkv_proj.weight", [nh * head_dim, nkv * head_dim,
                                                                       nkv * head_dim], h),
                            reader(src, a + "o_proj.weight", (h, nh * head_dim)))
        self.mlp.load(fused_readers(src, m + "gate_up_proj.weight", [inter, inter], h),
                      reader(src, m + "down_proj.weight", (h, inter)))


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return [getattr(config, "sliding_window", None) or None] * config.num_hidden_layers

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        start, end = self.stage_layers(config.num_hidden_layers, layer_partition)
        first, last, tied = self.ps.is_first_stage, self.ps.is_last_stage, bool(config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   materialize=first or (last and tied))
        self.rotary = RotaryEmbedding(config, self.head_dim, max_model_len, dtype)
        windows = self.sliding_windows(config)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(config, dtype, backend, self.rotary, self.head_dim, windows[i]) for i in range(start, end)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=tied, materialize=last)
        self.num_kv_heads_local = self.layers[0].self_attn.attn.num_kv_heads if len(self.layers) else 0

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """CausalLM.forward with each layer's residual add deferred into the next norm (fused add + RMSNorm)."""
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
            layer.load(src, f"{p}layers.{self.start_layer + i}.", c, self.head_dim)
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + "norm.weight", (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))
