"""Gemma2ForCausalLM: Gemma's decoder with "sandwich" norms and soft-capping.

Per layer: x + post_attention_norm(attn(input_norm(x))), then x + post_feedforward_norm(mlp(pre_feedforward_norm(x))),
every norm a (1 + w) RMSNorm. Attention scales queries by query_pre_attn_scalar^-0.5 and soft-caps its logits;
layers alternate between a sliding window (even layers, or as config.layer_types says) and the full context. The
MLP is GeGLU (gelu, tanh approximation). Embeddings are scaled by sqrt(hidden) in the model dtype, the LM head is
tied to them, and the final logits are soft-capped too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shoal.engine.execution.layers.decoder import GatedMLP, SelfAttention
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.norm import GemmaRMSNorm
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, dtype, attn: SelfAttention):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attn
        self.mlp = GatedMLP(h, config.intermediate_size, _activation(config), dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def load(self, src, p: str, config, head_dim: int):
        h, nh, nkv, inter = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, \
            config.intermediate_size
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            getattr(self, name).weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
        a, m = p + "self_attn.", p + "mlp."
        rows = {"q": nh * head_dim, "k": nkv * head_dim, "v": nkv * head_dim}
        self.self_attn.load([reader(src, f"{a}{n}_proj.weight", (rows[n], h)) for n in "qkv"],
                            reader(src, a + "o_proj.weight", (h, nh * head_dim)))
        if self.self_attn.q_norm is not None:
            self.self_attn.q_norm.weight.data.copy_(src.load(a + "q_norm.weight", (head_dim,)))
            self.self_attn.k_norm.weight.data.copy_(src.load(a + "k_norm.weight", (head_dim,)))
        self.mlp.load([reader(src, f"{m}{n}_proj.weight", (inter, h)) for n in ("gate", "up")],
                      reader(src, m + "down_proj.weight", (h, inter)))


def _activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"


class Gemma2ForCausalLM(CausalLM):
    qk_norm = False  # Gemma 3 normalises queries and keys per head

    @classmethod
    def layer_types(cls, config) -> list[str]:
        types = getattr(config, "layer_types", None)
        if types:
            return list(types)
        return [SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        return [window if t == SLIDING and window else None for t in cls.layer_types(config)]

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict[str, RotaryEmbedding]:
        """One RoPE table per layer type (Gemma 2 uses the same for both)."""
        shared = RotaryEmbedding(config, self.head_dim, max_model_len, dtype)
        return {SLIDING: shared, FULL: shared}

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        start, end = self.stage_layers(config.num_hidden_layers, layer_partition)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        tied = bool(getattr(config, "tie_word_embeddings", True))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   materialize=first or (last and tied))
        # sqrt(hidden) rounded to the model dtype first, as transformers multiplies it.
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype))
        rotaries = self.make_rotaries(config, max_model_len, dtype)
        self.rotaries = nn.ModuleList(dict.fromkeys(rotaries.values()))  # registered once each (buffers follow .to)
        types, windows = self.layer_types(config), self.sliding_windows(config)
        scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        softcap = getattr(config, "attn_logit_softcapping", None)
        layers = []
        for i in range(start, end):
            qk_norm = None
            if self.qk_norm:
                qk_norm = (GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype),
                           GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype))
            attn = SelfAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                 self.head_dim, dtype, backend, rotaries[types[i]], scale,
                                 bias=bool(getattr(config, "attention_bias", False)), sliding_window=windows[i],
                                 softcap=softcap, qk_norm=qk_norm)
            layers.append(GemmaDecoderLayer(config, dtype, attn))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=tied, materialize=last)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.num_kv_heads_local = self.layers[0].self_attn.attn.num_kv_heads if len(self.layers) else 0

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.embed_scale

    def final_norm(self, hidden):
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, src) -> None:
        c = self.config
        p = find_prefix(src, ["model.", "model.language_model.", ""], "norm.weight")
        shape = (c.vocab_size, c.hidden_size)
        if self.ps.is_first_stage or (self.ps.is_last_stage and self.lm_head.tied):
            self.embed_tokens.load(reader(src, p + "embed_tokens.weight", shape))
        for i, layer in enumerate(self.layers):
            layer.load(src, f"{p}layers.{self.start_layer + i}.", c, self.head_dim)
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + "norm.weight", (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))
