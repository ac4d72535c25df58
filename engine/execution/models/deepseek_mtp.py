"""DeepSeek V3's multi-token-prediction (MTP) layer, the module speculative MTP runs (execution/mtp.py).

A checkpoint with `num_nextn_predict_layers: 1` stores it as one more layer after the decoder's, under
`model.layers.{num_hidden_layers}.`: `enorm` and `hnorm` (RMSNorms), `eh_proj` (Linear 2H -> H), a full decoder
layer (the same MLA attention and MoE as the main layers' sparse ones, under the usual names), `shared_head.norm`
and `shared_head.head`, and optionally its own `embed_tokens` (where absent, the target's embedding and LM head
serve). transformers reads none of it.

For position i of the MTP stream: x = eh_proj([enorm(embed(token_{i+1})), hnorm(h_i)]), h_i the target's hidden state
at i after its final norm (what its LM head reads); the decoder layer attends over the MTP stream's earlier positions
(its own latent KV cache); o_i = shared_head.norm(layer output) gives logits shared_head.head(o_i) for token_{i+2},
and o_i stands in for the target's hidden state when the layer is applied again to its own proposal. Both hidden
states are taken after their norms, as vLLM takes them (its GLM/DeepSeek MTP fix, vllm#47448: recycling them before
the norm mismatches hnorm and lowers acceptance).
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.mla import LatentKVCache, ReplicatedLinear
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.models.base import find_prefix, reader
from shoal.engine.execution.models.decoder import DecoderLayer

# What a checkpoint's MTP layer must have (the decoder layer's own tensors are checked as they load).
REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def mtp_prefix(src, config) -> str:
    """Where the checkpoint keeps the MTP layer: the decoder's prefix, layer index num_hidden_layers."""
    return f"{find_prefix(src, ['model.', ''], 'norm.weight')}layers.{config.num_hidden_layers}."


class DeepseekMTP(nn.Module):
    def __init__(self, target, src, dtype: torch.dtype, backend):
        """Built beside `target` (a DeepseekV3ForCausalLM of every layer) from the checkpoint `src` (has())."""
        super().__init__()
        c = self.config = target.config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.prefix = mtp_prefix(src, c)
        self.enorm, self.hnorm = RMSNorm(h, eps, dtype), RMSNorm(h, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, dtype)
        index = c.num_hidden_layers  # the MoE choice (first_k_dense_replace) sees the layer's real index
        self.layer = DecoderLayer(target.make_attention(index, dtype, backend, target.rotaries[0], None),
                                  target.make_mlp(index, dtype), h, eps, dtype)
        self.norm = RMSNorm(h, eps, dtype)  # shared_head.norm
        self._target = target
        # Own embedding / head where the checkpoint has them; the target's otherwise (kept out of the submodules,
        # so that formats chosen for this module never touch the target's).
        self.own_embed = (VocabParallelEmbedding(c.vocab_size, h, dtype)
                          if src.has(self.prefix + "embed_tokens.weight") else None)
        self.own_head = None
        if src.has(self.prefix + "shared_head.head.weight"):
            self.own_head = ParallelLMHead(self.own_embed or target.embed_tokens, tied=False)

    @property
    def embed_tokens(self):
        return self.own_embed if self.own_embed is not None else self._target.embed_tokens

    @property
    def head(self):
        return self.own_head if self.own_head is not None else self._target.lm_head

    def load_weights(self, src) -> None:
        c, p = self.config, self.prefix
        h = c.hidden_size
        for name, norm in (("enorm", self.enorm), ("hnorm", self.hnorm), ("shared_head.norm", self.norm)):
            norm.weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
        self.eh_proj.load(reader(src, p + "eh_proj.weight", (h, 2 * h)))
        layer = self.layer
        for name in layer.norm_names:
            getattr(layer, name).weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
        layer.self_attn.load(src, p + "self_attn.")
        self._target.load_mlp(layer.mlp, src, p, c.num_hidden_layers)
        shape = (c.vocab_size, h)
        if self.own_embed is not None:
            self.own_embed.load(reader(src, p + "embed_tokens.weight", shape))
        if self.own_head is not None:
            self.own_head.load(reader(src, p + "shared_head.head.weight", shape))

    def cache_bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
        return LatentKVCache.bytes_per_token_head(self._target.head_dim, dtype, kv_cache_dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, dtype, device, kv_cache_dtype: str | None):
        return LatentKVCache.allocate(num_blocks, block_size, 1, self._target.head_dim, dtype, device, kv_cache_dtype)

    def forward(self, input_ids, positions, prev_hidden, kv_cache, meta) -> torch.Tensor:
        """o [T, H] (after shared_head.norm) for rows of (token_{i+1}, position i, h_i)."""
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(prev_hidden.to(e.dtype))], dim=-1))
        x, delta = self.layer(x, positions, kv_cache, meta)
        return self.norm.add_and_norm(x, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


MTP = DeepseekMTP  # what execution/mtp.py builds for this family
