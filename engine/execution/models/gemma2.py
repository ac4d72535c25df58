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

from shoal.engine.execution.layers.norm import GemmaRMSNorm
from shoal.engine.execution.models.decoder import FULL, SLIDING, DecoderLM, SandwichDecoderLayer


class Gemma2ForCausalLM(DecoderLM):
    layer_cls = SandwichDecoderLayer
    norm_cls = GemmaRMSNorm
    prefixes = ("model.", "model.language_model.", "")

    @classmethod
    def default_layer_types(cls, config) -> list[str]:
        return [SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        # sqrt(hidden) rounded to the model dtype first, as transformers multiplies it.
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype))
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def attention_options(self, layer_idx: int) -> dict:
        c = self.config
        return dict(super().attention_options(layer_idx), norm_cls=GemmaRMSNorm,
                    scale=(getattr(c, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5,
                    softcap=getattr(c, "attn_logit_softcapping", None))

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
