"""Qwen3-Next's and Qwen3.5's multi-token-prediction (MTP) layer, the module speculative MTP runs for them
(execution/mtp.py).

The checkpoint keeps it at the root, under `mtp.`: `pre_fc_norm_embedding` and `pre_fc_norm_hidden` (zero-centred
RMSNorms, as every norm of these families), `fc` (Linear 2H -> H, the embedding's half first), one full-attention
decoder layer `layers.0` (the gated attention and MLP of the main full-attention layers: sparse with a shared
expert in the MoE models, a SwiGLU in Qwen3.5's dense ones) and `norm`. The embedding and the LM head are the
target's. transformers reads none of it.

For position i of the MTP stream: x = fc([norm_e(embed(token_{i+1})), norm_h(h_i)]), h_i the target's hidden state
at i after its final norm; the layer attends over the MTP stream's earlier positions (a paged KV cache of its own);
o_i = norm(layer output) gives logits lm_head(o_i) for token_{i+2} and stands in for the target's hidden state when
the layer is applied again to its own proposal.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.mla import ReplicatedLinear
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.layers.norm import GemmaRMSNorm
from shoal.engine.execution.models.base import reader
from shoal.engine.execution.models.decoder import FULL, DecoderLayer, DecoderLM

PREFIX = "mtp."
# What a checkpoint's MTP layer must have (the decoder layer's own tensors are checked as they load).
REQUIRED = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_prefix(src, config) -> str:
    return PREFIX


class Qwen3NextMTP(nn.Module):
    own_embed = own_head = None  # the target's embedding and LM head serve

    def __init__(self, target, src, dtype: torch.dtype, backend):
        """Built beside `target` (a Qwen3NextForCausalLM or Qwen3.5 decoder of every layer) from the checkpoint
        `src` (has())."""
        super().__init__()
        c = self.config = target.config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.prefix = PREFIX
        for name in NORMS:
            setattr(self, name, GemmaRMSNorm(h, eps, dtype))
        self.fc = ReplicatedLinear(2 * h, h, False, dtype)
        index = c.num_hidden_layers  # past the decoder's: its MLP is chosen by what the checkpoint holds
        sparse = src.has(PREFIX + "layers.0.mlp.gate.weight")
        mlp = target.moe_block(dtype) if sparse else DecoderLM.make_mlp(target, index, dtype)
        attention = target.make_mixer(index, FULL, None, {FULL: target.rotaries[0]}, dtype, backend)
        self.layer = DecoderLayer(attention, mlp, h, eps, dtype, GemmaRMSNorm)
        self._target = target

    @property
    def embed_tokens(self):
        return self._target.embed_tokens

    @property
    def head(self):
        return self._target.lm_head

    def load_weights(self, src) -> None:
        h, p = self.config.hidden_size, PREFIX
        for name in NORMS:
            getattr(self, name).weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
        self.fc.load(reader(src, p + "fc.weight", (h, 2 * h)))
        lp = p + "layers.0."
        for name in self.layer.norm_names:
            getattr(self.layer, name).weight.data.copy_(src.load(f"{lp}{name}.weight", (h,)))
        self.layer.self_attn.load(src, lp + "self_attn.")
        mlp = self.layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            from shoal.engine.execution.models.moe import load_moe_block

            load_moe_block(mlp, src, lp + "mlp.")
        else:
            mlp.load(src, lp + "mlp.")

    def cache_bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
        attn = self.layer.self_attn.attn
        return self._target.kv_cache_class.bytes_per_token_head(self._target.head_dim, dtype, kv_cache_dtype) * \
            attn.num_kv_heads

    def allocate_cache(self, num_blocks: int, block_size: int, dtype, device, kv_cache_dtype: str | None):
        return self._target.kv_cache_class.allocate(num_blocks, block_size, self.layer.self_attn.attn.num_kv_heads,
                                                    self._target.head_dim, dtype, device, kv_cache_dtype)

    def forward(self, input_ids, positions, prev_hidden, kv_cache, meta) -> torch.Tensor:
        """o [T, H] (after the MTP norm) for rows of (token_{i+1}, position i, h_i)."""
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(prev_hidden.to(e.dtype))], dim=-1))
        x, delta = self.layer(x, positions, kv_cache, meta)
        return self.norm.add_and_norm(x, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


MTP = Qwen3NextMTP  # what execution/mtp.py builds for these families
