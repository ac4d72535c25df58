"""GraniteMoeHybridForCausalLM (Granite 4): Mamba2 layers mixed with full attention, each layer's MLP a mixture of
experts plus an always-on shared MLP, and Granite's muP multipliers.

- Layer types from config.layer_types: "mamba" / "linear_attention" (a Mamba2 mixer, layers/mamba2.py, its state in
  the hybrid caches of models/hybrid.py) and "attention" / "full_attention"; anything else is refused at load.
- Attention: grouped-query, softmax scale attention_multiplier (instead of head_dim^-1/2); RoPE only where
  position_embedding_type is "rope" (the releases use none: the Mamba layers carry the positions).
- The multipliers: embeddings times embedding_multiplier, each mixer's and each MLP's output times
  residual_multiplier before its residual add, logits divided by logits_scaling.
- MLP: softmax over the top-k router logits (= renormalised top-k) into the fused experts (block_sparse_moe:
  input_linear [E, 2I, H] = gate rows then up rows, output_linear [E, H, I]), plus shared_mlp (input_linear
  [2S, H], output_linear [H, S]) on every token; only the shared MLP when num_local_experts is 0.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from shoal.engine.execution.layers.mlp import GatedMLP
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.models.base import fused_readers, reader
from shoal.engine.execution.models.decoder import FULL, DecoderLayer, DecoderLM
from shoal.engine.execution.models.hybrid import HybridCaches
from shoal.engine.execution.models.moe import check_silu_experts

MAMBA = "linear_attention"
_NAMES = {"mamba": MAMBA, MAMBA: MAMBA, "attention": FULL, FULL: FULL}  # legacy and current names


class NoPositions(nn.Module):
    """The RoPE table of attention without positions (NoPE): rotates nothing."""

    def rotate_(self, positions, qkv, heads) -> None:
        pass


class ScaledResidualLayer(DecoderLayer):
    """Pre-norm layer whose mixer and MLP outputs are scaled by residual_multiplier before their residual adds."""

    residual_multiplier = 1.0

    def forward(self, x, positions, kv_cache, meta, delta=None):
        m = self.residual_multiplier
        attn_out = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, kv_cache, meta) * m
        return x, self.mlp(self.post_attention_layernorm.add_and_norm(x, attn_out)) * m


def mamba2_shape(config, prefix: str = "mamba_") -> Mamba2Shape:
    """The Mamba2 layers' shape from Granite-style fields (mamba_n_heads, mamba_d_head, ...), checked for
    consistency with the field named."""
    c = config

    def field(name):
        return getattr(c, prefix + name)

    heads, head_dim, groups = field("n_heads"), field("d_head"), field("n_groups")
    inner = field("expand") * c.hidden_size
    if heads * head_dim != inner:
        raise ValueError(f"{c.architectures[0]} config: {prefix}n_heads ({heads}) x {prefix}d_head ({head_dim}) must "
                         f"equal {prefix}expand x hidden_size ({inner})")
    if groups <= 0 or heads % groups:
        raise ValueError(f"{c.architectures[0]} config: {prefix}n_groups ({groups}) must divide {prefix}n_heads "
                         f"({heads})")
    limit = tuple(getattr(c, "time_step_limit", None) or (0.0, float("inf")))
    return Mamba2Shape(hidden=c.hidden_size, heads=heads, head_dim=head_dim, groups=groups, d_state=field("d_state"),
                       conv_kernel=field("d_conv"), conv_bias=bool(field("conv_bias")),
                       proj_bias=bool(field("proj_bias")), eps=c.rms_norm_eps, norm_groups=groups,
                       time_step_limit=(float(limit[0]), float(limit[1])))


class GraniteMoeHybridForCausalLM(HybridCaches, DecoderLM):
    layer_cls = ScaledResidualLayer

    def __init__(self, config, dtype, backend, max_model_len, layer_partition=None):
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"GraniteMoeHybrid config: hidden_act {config.hidden_act!r} is not supported (the Mamba "
                             "conv and the experts run silu)")
        if (config.position_embedding_type or "nope") not in ("rope", "nope"):
            raise ValueError(f"GraniteMoeHybrid config: position_embedding_type {config.position_embedding_type!r} "
                             "must be 'rope' or none")
        self.mamba_shape = mamba2_shape(config)
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        for layer in self.layers:
            layer.residual_multiplier = float(config.residual_multiplier)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(types) - set(_NAMES))
        if unknown or len(types) != config.num_hidden_layers:
            raise ValueError(f"GraniteMoeHybrid config: layer_types {types} must give 'mamba' or 'attention' for each "
                             f"of the {config.num_hidden_layers} layers (num_hidden_layers)"
                             + (f"; unsupported layer type(s) {unknown}" if unknown else ""))
        return [_NAMES[t] for t in types]

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_rotaries(self, config, max_model_len, dtype) -> dict:
        if config.position_embedding_type == "rope":
            return super().make_rotaries(config, max_model_len, dtype)
        return {FULL: NoPositions()}

    def make_mixer(self, layer_idx, layer_type, window, rotaries, dtype, backend) -> nn.Module:
        if layer_type == MAMBA:
            return Mamba2Mixer(self.mamba_shape, dtype)
        c = self.config
        bias = bool(c.attention_bias)
        return RotaryAttention(c, dtype, backend, rotaries[FULL], self.head_dim, scale=float(c.attention_multiplier),
                               qkv_bias=bias, o_bias=bias)

    def mixer_prefix(self, layer_idx: int) -> str:
        return "mamba." if self.layer_types(self.config)[layer_idx] == MAMBA else "self_attn."

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        if not c.num_local_experts:
            return GatedMLP(c.hidden_size, c.shared_intermediate_size, dtype)
        check_silu_experts(c)
        return SparseMoeBlock(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
                              renormalize=True, dtype=dtype, shared_intermediate=c.shared_intermediate_size)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        c = self.config
        h, s = c.hidden_size, c.shared_intermediate_size
        shared = mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp
        shared.gate_up_proj.load(fused_readers(src, p + "shared_mlp.input_linear.weight", [s, s], h))
        shared.down_proj.load(reader(src, p + "shared_mlp.output_linear.weight", (h, s)))
        if not isinstance(mlp, SparseMoeBlock):
            return
        m, e, inter = p + "block_sparse_moe.", c.num_local_experts, c.intermediate_size
        mlp.gate.data.copy_(src.load(m + "router.layer.weight", (e, h)))
        experts = mlp.experts
        for i in experts.local_experts():
            def part(name, shape, offset=0, i=i):  # expert i's [rows, cols] of a stacked [E, ...] tensor
                return lambda dim, start, length: src.load(m + name, shape, dim=0, start=i, length=1)[0].narrow(
                    dim, offset + start if dim == 0 else start, length)

            experts.load_expert(i, part("input_linear.weight", (e, 2 * inter, h)),
                                part("input_linear.weight", (e, 2 * inter, h), inter),
                                part("output_linear.weight", (e, h, inter)))

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling

