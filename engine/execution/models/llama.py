"""Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.

RoPE, grouped-query attention (optional QKV bias for Qwen2), SwiGLU MLP, RMSNorm, tied or untied LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.fused import silu_and_mul
from shoal.engine.execution.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, dtype, backend, rotary: RotaryEmbedding, head_dim: int):
        super().__init__()
        h, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.qkv_proj = QKVParallelLinear(h, head_dim, nh, nkv, bias, dtype)
        self.o_proj = RowParallelLinear(nh * head_dim, h, False, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(backend, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                                   head_dim ** -0.5)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(h, [config.intermediate_size] * 2, mlp_bias, dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, h, mlp_bias, dtype)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Llama-family hidden_act {config.hidden_act!r} is not supported (only silu)")

    def forward(self, x, positions, kv_cache, meta, delta=None):
        """x: the residual stream, updated in place; delta: the previous layer's output, not yet added to it (so
        that the add fuses with this layer's first norm). Returns (x, this layer's output)."""
        qkv = self.qkv_proj.matmul(self.input_layernorm.add_and_norm(x, delta), self.qkv_proj.bias)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Queries and keys sit side by side in the fused projection: rotate both in place in one pass.
        self.rotary.rotate_(positions, qkv, self.attn.num_heads + self.attn.num_kv_heads)
        q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
        h = self.post_attention_layernorm.add_and_norm(x, self.o_proj(self.attn(q, k, v, kv_cache, meta)))
        return x, self.down_proj(silu_and_mul(self.gate_up_proj(h)))

    def load(self, src, p: str, config, head_dim: int):
        h, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        inter = config.intermediate_size
        a, m = p + "self_attn.", p + "mlp."
        self.input_layernorm.weight.data.copy_(src.load(p + "input_layernorm.weight", (h,)))
        self.post_attention_layernorm.weight.data.copy_(src.load(p + "post_attention_layernorm.weight", (h,)))
        shapes = {"q": (nh * head_dim, h), "k": (nkv * head_dim, h), "v": (nkv * head_dim, h)}
        self.qkv_proj.load(
            [reader(src, f"{a}{n}_proj.weight", shapes[n]) for n in "qkv"],
            [reader(src, f"{a}{n}_proj.bias", shapes[n][:1]) for n in "qkv"] if self.qkv_proj.bias is not None else None,
        )
        self.o_proj.load(reader(src, a + "o_proj.weight", (h, nh * head_dim)))
        bias = self.gate_up_proj.bias is not None
        self.gate_up_proj.load(
            [reader(src, f"{m}{n}_proj.weight", (inter, h)) for n in ("gate", "up")],
            [reader(src, f"{m}{n}_proj.bias", (inter,)) for n in ("gate", "up")] if bias else None,
        )
        self.down_proj.load(reader(src, m + "down_proj.weight", (h, inter)),
                            reader(src, m + "down_proj.bias", (h,)) if bias else None)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        start, end = self.stage_layers(config.num_hidden_layers, layer_partition)
        first, last, tied = self.ps.is_first_stage, self.ps.is_last_stage, bool(config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   materialize=first or (last and tied))
        self.rotary = RotaryEmbedding(config, self.head_dim, max_model_len, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, backend, self.rotary, self.head_dim) for _ in range(start, end)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=tied, materialize=last)
        self.num_kv_heads_local = self.layers[0].qkv_proj.num_kv_heads if len(self.layers) else 0

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """CausalLM.forward with each layer's residual add deferred into the next norm (fused add + RMSNorm)."""
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
            layer.load(src, f"{p}layers.{self.start_layer + i}.", c, self.head_dim)
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + "norm.weight", (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))
