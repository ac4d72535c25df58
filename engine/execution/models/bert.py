"""BertModel: the encoder-only embedding family (sentence-transformers' all-MiniLM, BGE, E5... checkpoints).

Word + learned absolute position + token-type (all type 0) embeddings, LayerNorm; each layer post-norm: bidirectional
self-attention (every token of a prompt sees every other), LayerNorm(x + attn), LayerNorm(x + MLP) with GELU. The
output is the last layer's hidden states, which the engine pools (core/pooling.py).

An encoder runs each prompt whole in one step and keeps no KV cache (`is_encoder`): attention is computed within
each prompt of the flat batch from this step's keys and values alone. Weights may carry a `bert.` prefix (a
BertFor... checkpoint) or none (BertModel, sentence-transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.execution.layers.activation import get_activation
from shoal.engine.execution.layers.embedding import VocabParallelEmbedding
from shoal.engine.execution.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import LayerNorm
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader
from shoal.engine.execution.weights import WeightError


class BertLayer(nn.Module):
    def __init__(self, config, dtype):
        super().__init__()
        h, nh = config.hidden_size, config.num_attention_heads
        eps = config.layer_norm_eps
        self.head_dim = h // nh
        self.qkv = QKVParallelLinear(h, self.head_dim, nh, nh, True, dtype)
        self.attn_out = RowParallelLinear(h, h, True, dtype)
        self.attn_norm = LayerNorm(h, eps, dtype)
        self.up = ColumnParallelLinear(h, config.intermediate_size, True, dtype)
        self.down = RowParallelLinear(config.intermediate_size, h, True, dtype)
        self.out_norm = LayerNorm(h, eps, dtype)
        self.act = get_activation(config.hidden_act)

    def attention(self, q, k, v, starts: list[int]) -> torch.Tensor:
        """Bidirectional attention within each prompt [starts[i], starts[i+1]) of the flat batch."""
        heads, d = self.qkv.num_heads, self.head_dim
        out = torch.empty_like(q)
        for a, b in zip(starts, starts[1:]):
            qi, ki, vi = (t[a:b].view(b - a, heads, d).transpose(0, 1) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1).reshape(b - a, heads * d)
        return out

    def forward(self, x, starts: list[int]):
        q, k, v = self.qkv(x)
        x = self.attn_norm(x + self.attn_out(self.attention(q, k, v, starts)))
        return self.out_norm(x + self.down(self.act(self.up(x))))

    def load(self, src, p: str, h: int, inner: int):
        a = p + "attention."
        self.qkv.load([reader(src, f"{a}self.{n}.weight", (h, h)) for n in ("query", "key", "value")],
                      [reader(src, f"{a}self.{n}.bias", (h,)) for n in ("query", "key", "value")])
        self.attn_out.load(reader(src, a + "output.dense.weight", (h, h)), reader(src, a + "output.dense.bias", (h,)))
        self.up.load(reader(src, p + "intermediate.dense.weight", (inner, h)),
                     reader(src, p + "intermediate.dense.bias", (inner,)))
        self.down.load(reader(src, p + "output.dense.weight", (h, inner)), reader(src, p + "output.dense.bias", (h,)))
        for norm, name in ((self.attn_norm, a + "output.LayerNorm"), (self.out_norm, p + "output.LayerNorm")):
            norm.weight.data.copy_(src.load(name + ".weight", (h,)))
            norm.bias.data.copy_(src.load(name + ".bias", (h,)))


class BertModel(CausalLM):
    is_encoder = True

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise WeightError(f"BertModel with position_embedding_type={config.position_embedding_type!r} is not "
                              "supported (absolute positions only)")
        if not (self.ps.is_first_stage and self.ps.is_last_stage):
            raise ValueError("BertModel runs on one process (no pipeline or tensor parallelism)")
        self.config = config
        h = config.hidden_size
        self.head_dim = h // config.num_attention_heads
        self.stage_layers(config.num_hidden_layers)
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, dtype)
        self.position_embeddings = nn.Parameter(torch.zeros(config.max_position_embeddings, h, dtype=dtype),
                                                requires_grad=False)
        self.token_type0 = nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False)  # token type 0's row
        self.embed_norm = LayerNorm(h, config.layer_norm_eps, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.num_kv_heads_local = config.num_attention_heads

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None) -> torch.Tensor:
        """The last layer's hidden states of every prompt in the step (each prompt whole, from position 0)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings[positions] + self.token_type0
        x = self.embed_norm(x)
        starts = meta.query_start_loc.tolist()
        for layer in self.layers:
            x = layer(x, starts)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder-only model has no LM head: it serves embeddings only")

    def load_weights(self, src) -> None:
        c = self.config
        h = c.hidden_size
        p = find_prefix(src, ["", "bert."], "embeddings.word_embeddings.weight")
        e = p + "embeddings."
        self.word_embeddings.load(reader(src, e + "word_embeddings.weight", (c.vocab_size, h)))
        self.position_embeddings.data.copy_(src.load(e + "position_embeddings.weight", (c.max_position_embeddings, h)))
        self.token_type0.data.copy_(src.load(e + "token_type_embeddings.weight", (c.type_vocab_size, h))[0])
        self.embed_norm.weight.data.copy_(src.load(e + "LayerNorm.weight", (h,)))
        self.embed_norm.bias.data.copy_(src.load(e + "LayerNorm.bias", (h,)))
        for i, layer in enumerate(self.layers):
            layer.load(src, f"{p}encoder.layer.{i}.", h, c.intermediate_size)
