"""BloomForCausalLM: ALiBi positional bias, LayerNorm, GELU, a LayerNorm right after the word embeddings.

BLOOM fuses Q, K and V per head ([heads, 3, head_dim] along the output dimension), so a tensor-parallel shard
of whole heads is one contiguous range of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.alibi import alibi_slopes
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import LayerNorm
from shoal.engine.distributed.parallel_state import divide
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader


class BloomBlock(nn.Module):
    def __init__(self, config, dtype, backend, slopes: torch.Tensor):
        super().__init__()
        h, nh = config.hidden_size, config.n_head
        self.head_dim = h // nh
        eps = config.layer_norm_epsilon
        self.post_ln_residual = bool(config.apply_residual_connection_post_layernorm)
        self.input_layernorm = LayerNorm(h, eps, dtype)
        self.query_key_value = ColumnParallelLinear(h, 3 * h, True, dtype)
        self.dense = RowParallelLinear(h, h, True, dtype)
        self.num_heads = self.query_key_value.out_local // (3 * self.head_dim)
        self.attn = PagedAttention(backend, self.num_heads, self.num_heads, self.head_dim,
                                   self.head_dim ** -0.5, alibi_slopes=slopes)
        self.post_attention_layernorm = LayerNorm(h, eps, dtype)
        self.dense_h_to_4h = ColumnParallelLinear(h, 4 * h, True, dtype)
        self.dense_4h_to_h = RowParallelLinear(4 * h, h, True, dtype)

    def forward(self, x, positions, kv_cache, meta):
        ln = self.input_layernorm(x)
        qkv = self.query_key_value(ln).view(x.shape[0], self.num_heads, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        attn = self.dense(self.attn(q, k, v, kv_cache, meta))
        x = attn + (ln if self.post_ln_residual else x)
        ln = self.post_attention_layernorm(x)
        mlp = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(ln), approximate="tanh"))
        return mlp + (ln if self.post_ln_residual else x)

    def load(self, src, p: str, h: int):
        for name in ("input_layernorm", "post_attention_layernorm"):
            mod = getattr(self, name)
            mod.weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
            mod.bias.data.copy_(src.load(f"{p}{name}.bias", (h,)))
        for name, lin, shape in (
            ("self_attention.query_key_value", self.query_key_value, (3 * h, h)),
            ("self_attention.dense", self.dense, (h, h)),
            ("mlp.dense_h_to_4h", self.dense_h_to_4h, (4 * h, h)),
            ("mlp.dense_4h_to_h", self.dense_4h_to_h, (h, 4 * h)),
        ):
            lin.load(reader(src, f"{p}{name}.weight", shape), reader(src, f"{p}{name}.bias", shape[:1]))


class BloomForCausalLM(CausalLM):
    uses_alibi = True

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        h, nh = config.hidden_size, config.n_head
        self.head_dim = h // nh
        local_heads = divide(nh, self.ps.tp_size, "number of attention heads")
        # Each rank attends with its own heads, so it takes those heads' slopes.
        slopes = alibi_slopes(nh)[self.ps.tp_rank * local_heads:(self.ps.tp_rank + 1) * local_heads].contiguous()
        start, end = self.stage_layers(config.n_layer, layer_partition)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, dtype, materialize=first or last)
        self.word_embeddings_layernorm = LayerNorm(h, config.layer_norm_epsilon, dtype)
        self.layers = nn.ModuleList(BloomBlock(config, dtype, backend, slopes) for _ in range(start, end))
        self.ln_f = LayerNorm(h, config.layer_norm_epsilon, dtype)
        self.lm_head = ParallelLMHead(self.word_embeddings, tied=True)
        self.num_kv_heads_local = local_heads

    def embed(self, input_ids, positions):
        return self.word_embeddings_layernorm(self.word_embeddings(input_ids))

    def final_norm(self, hidden):
        return self.ln_f(hidden)

    def load_weights(self, src) -> None:
        c = self.config
        h = c.hidden_size
        p = find_prefix(src, ["transformer.", ""], "ln_f.weight")
        if self.ps.is_first_stage or self.ps.is_last_stage:  # the LM head is tied to the embedding
            self.word_embeddings.load(reader(src, p + "word_embeddings.weight", (c.vocab_size, h)))
        if self.ps.is_first_stage:
            for n in ("weight", "bias"):
                getattr(self.word_embeddings_layernorm, n).data.copy_(src.load(f"{p}word_embeddings_layernorm.{n}", (h,)))
        for i, layer in enumerate(self.layers):
            layer.load(src, f"{p}h.{self.start_layer + i}.", h)
        if self.ps.is_last_stage:
            for n in ("weight", "bias"):
                getattr(self.ln_f, n).data.copy_(src.load(f"{p}ln_f.{n}", (h,)))
