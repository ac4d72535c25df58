"""GPT2LMHeadModel: learned absolute positions, LayerNorm, GELU, and Conv1D weights stored [in, out]."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.activation import get_activation
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import LayerNorm
from shoal.engine.execution.models.base import CausalLM, find_prefix, reader


class GPT2Block(nn.Module):
    def __init__(self, config, dtype, backend, layer_idx: int):
        super().__init__()
        h, nh = config.n_embd, config.n_head
        self.head_dim = h // nh
        inner = config.n_inner or 4 * h
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(h, eps, dtype)
        self.c_attn = QKVParallelLinear(h, self.head_dim, nh, nh, True, dtype)
        self.c_proj = RowParallelLinear(h, h, True, dtype)
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = PagedAttention(backend, self.c_attn.num_heads, self.c_attn.num_kv_heads, self.head_dim, scale)
        self.ln_2 = LayerNorm(h, eps, dtype)
        self.c_fc = ColumnParallelLinear(h, inner, True, dtype)
        self.mlp_proj = RowParallelLinear(inner, h, True, dtype)
        self.act = get_activation(config.activation_function)

    def forward(self, x, positions, kv_cache, meta):
        q, k, v = self.c_attn(self.ln_1(x))
        x = x + self.c_proj(self.attn(q, k, v, kv_cache, meta))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))

    def load(self, src, p: str, h: int, inner: int):
        for name in ("ln_1", "ln_2"):
            mod = getattr(self, name)
            mod.weight.data.copy_(src.load(f"{p}{name}.weight", (h,)))
            mod.bias.data.copy_(src.load(f"{p}{name}.bias", (h,)))
        # c_attn's [in, 3h] weight and [3h] bias hold q | k | v side by side along the output dimension.
        w = reader(src, p + "attn.c_attn.weight", (3 * h, h), transpose=True)
        b = reader(src, p + "attn.c_attn.bias", (3 * h,))

        def section(read, i):
            return lambda dim, start, length: read(dim, i * h + start, length)

        self.c_attn.load([section(w, i) for i in range(3)], [section(b, i) for i in range(3)])
        self.c_proj.load(reader(src, p + "attn.c_proj.weight", (h, h), transpose=True),
                         reader(src, p + "attn.c_proj.bias", (h,)))
        self.c_fc.load(reader(src, p + "mlp.c_fc.weight", (inner, h), transpose=True),
                       reader(src, p + "mlp.c_fc.bias", (inner,)))
        self.mlp_proj.load(reader(src, p + "mlp.c_proj.weight", (h, inner), transpose=True),
                           reader(src, p + "mlp.c_proj.bias", (h,)))


class GPT2LMHeadModel(CausalLM):
    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        h = config.n_embd
        self.head_dim = h // config.n_head
        start, end = self.stage_layers(config.n_layer, layer_partition)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        self.wte = VocabParallelEmbedding(config.vocab_size, h, dtype, materialize=first or last)
        self.wpe = nn.Parameter(torch.zeros(config.n_positions if first else 0, h, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(GPT2Block(config, dtype, backend, i) for i in range(start, end))
        self.ln_f = LayerNorm(h, config.layer_norm_epsilon, dtype)
        self.lm_head = ParallelLMHead(self.wte, tied=True)
        self.num_kv_heads_local = self.layers[0].c_attn.num_kv_heads if len(self.layers) else 0

    def embed(self, input_ids, positions):
        return self.wte(input_ids) + self.wpe[positions]

    def final_norm(self, hidden):
        return self.ln_f(hidden)

    def load_weights(self, src) -> None:
        c = self.config
        h, inner = c.n_embd, c.n_inner or 4 * c.n_embd
        p = find_prefix(src, ["transformer.", ""], "ln_f.weight")
        if self.ps.is_first_stage or self.ps.is_last_stage:  # the LM head is tied to the embedding
            self.wte.load(reader(src, p + "wte.weight", (c.vocab_size, h)))
        if self.ps.is_first_stage:
            self.wpe.data.copy_(src.load(p + "wpe.weight", (c.n_positions, h)))
        for i, layer in enumerate(self.layers):
            layer.load(src, f"{p}h.{self.start_layer + i}.", h, inner)
        if self.ps.is_last_stage:
            self.ln_f.weight.data.copy_(src.load(p + "ln_f.weight", (h,)))
            self.ln_f.bias.data.copy_(src.load(p + "ln_f.bias", (h,)))
