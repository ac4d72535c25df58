"""The decoder-only transformer every rotary family plugs into: token embedding, layers of (norm, rotary
self-attention, norm, MLP) with residuals, final norm, tied or untied LM head.

A family (llama.py, qwen3.py, phi3.py, gemma2.py, gemma3.py, moe.py, gpt_oss.py) says only what differs:
- per layer, its attention options (`attention_options`: biases, q/k norm, scale, soft-cap, clipping; the window
  and the RoPE table come from `layer_types`/`sliding_windows` and `make_rotaries`) and its MLP (`make_mlp`: a dense
  GatedMLP or a SparseMoeBlock; `load_mlp`: where its checkpoint keeps that MLP's tensors);
- the layer's norm placement (`layer_cls`: pre-norm DecoderLayer, or Gemma's SandwichDecoderLayer) and norm kind
  (`norm_cls`);
- embedding scaling (`embed`) and logit soft-capping (`compute_logits`) where it has them.

Each layer's residual add is deferred into the next layer's first norm (one fused add + RMSNorm kernel on CPU): a
layer takes the residual stream x and the previous layer's output delta, and returns x and its own output.
Checkpoint names are Hugging Face's ("model.layers.{i}.self_attn.q_proj.weight", ...); GGUF files are read
through the same names (gguf_model.py).
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
from shoal.engine.execution.weights import parallel_map

SLIDING, FULL = "sliding_attention", "full_attention"


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(input_norm(x)), then x + mlp(post_attention_norm(x))."""

    norm_names = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, self_attn: RotaryAttention, mlp: nn.Module, hidden: int, eps: float, dtype: torch.dtype,
                 norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.input_layernorm = norm_cls(hidden, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm_cls(hidden, eps, dtype)
        self.mlp = mlp

    def forward(self, x, positions, kv_cache, meta, delta=None):
        """x: the residual stream, updated in place; delta: the previous layer's output, not yet added to it.
        Returns (x, this layer's output)."""
        attn_out = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, kv_cache, meta)
        return x, self.mlp(self.post_attention_layernorm.add_and_norm(x, attn_out))


class SandwichDecoderLayer(nn.Module):
    """Gemma's norms on both sides of each block: x + post_attention_norm(attn(input_norm(x))), then
    x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

    def __init__(self, self_attn: RotaryAttention, mlp: nn.Module, hidden: int, eps: float, dtype: torch.dtype,
                 norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        for name in self.norm_names:
            setattr(self, name, norm_cls(hidden, eps, dtype))

    def forward(self, x, positions, kv_cache, meta, delta=None):
        attn_out = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, kv_cache, meta)
        x.add_(self.post_attention_layernorm(attn_out))
        return x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderLM(CausalLM):
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    qk_norm: str | None = None  # None, "head" (per head over head_dim) or "full" (over the whole projection)
    prefixes = ("model.", "")  # where the checkpoint keeps the decoder's tensors (the LM head sits at the root)
    final_norm_name = "norm"  # the final norm's name under that prefix
    # [KV slots, hidden]: where each step writes every row's final hidden state (after the final norm: what the LM
    # head reads) at the row's KV slot, so it lives in the paged pool's slots with the KV (set by
    # ModelRunner.allocate_kv_cache for speculative MTP only)
    hidden_sink: torch.Tensor | None = None

    def __init__(self, config, dtype: torch.dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        start, end = self.stage_layers(config.num_hidden_layers, layer_partition)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   materialize=first or (last and tied))
        rotaries = self.make_rotaries(config, max_model_len, dtype)
        self.rotaries = nn.ModuleList(dict.fromkeys(rotaries.values()))  # registered once each (buffers follow .to)
        types, windows = self.layer_types(config), self.sliding_windows(config)
        self.layers = nn.ModuleList(
            self.layer_cls(self.make_mixer(i, types[i], windows[i], rotaries, dtype, backend),
                           self.make_mlp(i, dtype), config.hidden_size, config.rms_norm_eps, dtype, self.norm_cls)
            for i in range(start, end)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=tied, materialize=last)
        # Hybrids (models/hybrid.py) have layers without paged attention: the first attention layer tells.
        self.num_kv_heads_local = next((layer.self_attn.attn.num_kv_heads for layer in self.layers
                                        if hasattr(layer.self_attn, "attn")), 0)

    # ---- what a family overrides

    @classmethod
    def layer_types(cls, config) -> list[str]:
        """Each layer's attention type: config.layer_types where the config has it (transformers writes it for
        families that mix windowed and global layers), else the family's default."""
        types = list(getattr(config, "layer_types", None) or cls.default_layer_types(config))
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown or len(types) != config.num_hidden_layers:
            raise ValueError(f"{cls.__name__}: layer_types {types} must give one of {SLIDING!r} or {FULL!r} for each "
                             f"of the {config.num_hidden_layers} layers")
        return types

    @classmethod
    def default_layer_types(cls, config) -> list[str]:
        """Every layer windowed when the config has a sliding_window (Mistral, Phi-3), else every layer global."""
        return [SLIDING if getattr(config, "sliding_window", None) else FULL] * config.num_hidden_layers

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        window = getattr(config, "sliding_window", None) or None
        return [window if t == SLIDING else None for t in cls.layer_types(config)]

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict[str, RotaryEmbedding]:
        """The RoPE table of each layer type (one shared table unless a family rotates its types differently)."""
        shared = RotaryEmbedding(config, self.head_dim, max_model_len, dtype)
        return {SLIDING: shared, FULL: shared}

    def make_mixer(self, layer_idx: int, layer_type: str, window: int | None, rotaries: dict, dtype,
                   backend) -> nn.Module:
        """Layer `layer_idx`'s token mixer: its attention (hybrids add recurrent layers)."""
        return self.make_attention(layer_idx, dtype, backend, rotaries[layer_type], window)

    def mixer_prefix(self, layer_idx: int) -> str:
        """Where the checkpoint keeps layer `layer_idx`'s token mixer, under the layer's prefix."""
        return "self_attn."

    def make_attention(self, layer_idx: int, dtype, backend, rotary: RotaryEmbedding, window: int | None) -> nn.Module:
        """Layer `layer_idx`'s attention: a RotaryAttention with the family's options (MLA families replace it)."""
        return RotaryAttention(self.config, dtype, backend, rotary, self.head_dim, sliding_window=window,
                               **self.attention_options(layer_idx))

    def attention_options(self, layer_idx: int) -> dict:
        """Keyword arguments of layer `layer_idx`'s RotaryAttention besides its window and RoPE table."""
        c = self.config
        bias = bool(getattr(c, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm, clip_qkv=getattr(c, "clip_qkv", None))

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, dtype, activation=hidden_activation(c),
                        bias=bool(getattr(c, "mlp_bias", False)))

    def load_mlp(self, mlp: nn.Module, src, p: str, layer_idx: int) -> None:
        """Load layer `layer_idx`'s MLP from the tensors under the layer prefix `p`."""
        mlp.load(src, p + "mlp.")

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    # ---- the shared skeleton

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        # The residual stream is updated in place: a stage's input from the previous stage is copied first. The
        # first stage takes `hidden` as its embeddings where the runner made them (image features placed in them).
        x = self.embed(input_ids, positions) if hidden is None else hidden.clone()
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, positions, kv_caches[i], meta, delta)
        if self.ps.is_last_stage:
            out = self.norm.add_and_norm(x, delta)
            if self.hidden_sink is not None:  # speculative MTP reads it per position (execution/mtp.py)
                self.hidden_sink.index_copy_(0, meta.slot_mapping, out)
            return out
        return x if delta is None else x.add_(delta)

    def final_norm(self, hidden):
        return self.norm(hidden)

    def load_weights(self, src) -> None:
        c = self.config
        norm = self.final_norm_name + ".weight"
        p = find_prefix(src, list(self.prefixes), norm)
        shape = (c.vocab_size, c.hidden_size)
        if self.ps.is_first_stage or (self.ps.is_last_stage and self.lm_head.tied):
            self.embed_tokens.load(reader(src, p + "embed_tokens.weight", shape))

        def load_layer(i: int) -> None:
            layer, idx = self.layers[i], self.start_layer + i
            lp = f"{p}layers.{idx}."
            for name in layer.norm_names:
                getattr(layer, name).weight.data.copy_(src.load(f"{lp}{name}.weight", (c.hidden_size,)))
            layer.self_attn.load(src, lp + self.mixer_prefix(idx))
            self.load_mlp(layer.mlp, src, lp, idx)

        # layers are independent: a source that allows it (plain safetensors) loads several at once
        parallel_map(load_layer, range(len(self.layers)), getattr(src, "threads", 1))
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + norm, (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))


def hidden_activation(config) -> str:
    """The MLP activation's Hugging Face name (Gemma configs call it hidden_activation)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
