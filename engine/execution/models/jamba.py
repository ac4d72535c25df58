"""JambaForCausalLM (AI21's Jamba, 1.5 and Reasoning): Mamba (v1) layers with one attention layer in every
attn_layer_period, and a mixture of experts as the MLP of one layer in every expert_layer_period.

- Layer types from the config (transformers' layers_block_type): attention where i % attn_layer_period ==
  attn_layer_offset, Mamba elsewhere (layers/mamba.py: a decay per channel and state, the time step, B and C
  RMS-normalised; its state in the hybrid caches of models/hybrid.py).
- Attention: grouped-query without positions (the Mamba layers carry them), softmax scale head_dim^-1/2.
- MLP: layers_num_experts > 1 -> num_experts SwiGLU experts, top-k of the router's softmax *not* renormalised
  (feed_forward.router, feed_forward.experts: per-expert tensors or transformers 5's stacked gate_up_proj /
  down_proj); else a dense SwiGLU MLP. Pre-norms input_layernorm and pre_ff_layernorm; final_layernorm.
"""

from __future__ import annotations

from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.mamba import MambaMixer, MambaShape
from shoal.engine.execution.layers.mlp import GatedMLP
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.models.decoder import FULL, DecoderLayer, DecoderLM
from shoal.engine.execution.models.granitemoehybrid import NoPositions
from shoal.engine.execution.models.hybrid import HybridCaches
from shoal.engine.execution.models.moe import check_silu_experts, load_moe_block

MAMBA = "linear_attention"
_NAMES = {"mamba": MAMBA, "attention": FULL}


class JambaLayer(DecoderLayer):
    """A pre-norm layer whose second norm the checkpoint calls pre_ff_layernorm."""

    norm_names = ("input_layernorm", "pre_ff_layernorm")

    @property
    def pre_ff_layernorm(self) -> nn.Module:
        return self.post_attention_layernorm


class JambaForCausalLM(HybridCaches, DecoderLM):
    layer_cls = JambaLayer
    final_norm_name = "final_layernorm"

    def __init__(self, config, dtype, backend, max_model_len, layer_partition=None):
        c = config
        self.layer_types(c)
        if c.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Jamba config: hidden_act {c.hidden_act!r} is not supported (the Mamba conv and the "
                             "experts run silu)")
        for field in ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"):
            value = getattr(c, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Jamba config: {field} must be a positive integer, not {value!r}")
        self.mamba_shape = MambaShape(hidden=c.hidden_size, inner=c.mamba_expand * c.hidden_size,
                                      d_state=c.mamba_d_state, conv_kernel=c.mamba_d_conv, dt_rank=c.mamba_dt_rank,
                                      conv_bias=bool(c.mamba_conv_bias), proj_bias=bool(c.mamba_proj_bias),
                                      eps=c.rms_norm_eps)
        super().__init__(config, dtype, backend, max_model_len, layer_partition)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        c = config
        for offset, period in (("attn_layer_offset", "attn_layer_period"),
                               ("expert_layer_offset", "expert_layer_period")):
            if not 0 <= getattr(c, offset) < getattr(c, period):
                raise ValueError(f"Jamba config: {offset} ({getattr(c, offset)}) must lie in [0, {period} "
                                 f"({getattr(c, period)}))")
        types = list(c.layers_block_type)
        unknown = sorted(set(types) - set(_NAMES))
        if unknown or len(types) != c.num_hidden_layers:
            raise ValueError(f"Jamba config: layer types {types} must be 'mamba' or 'attention' for each of the "
                             f"{c.num_hidden_layers} layers")
        return [_NAMES[t] for t in types]

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_rotaries(self, config, max_model_len, dtype) -> dict:
        return {FULL: NoPositions()}

    def make_mixer(self, layer_idx, layer_type, window, rotaries, dtype, backend) -> nn.Module:
        if layer_type == MAMBA:
            return MambaMixer(self.mamba_shape, dtype)
        return RotaryAttention(self.config, dtype, backend, rotaries[FULL], self.head_dim)

    def mixer_prefix(self, layer_idx: int) -> str:
        return "mamba." if self.layer_types(self.config)[layer_idx] == MAMBA else "self_attn."

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        if c.layers_num_experts[layer_idx] > 1:
            check_silu_experts(c)
            return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.intermediate_size,
                                  renormalize=False, dtype=dtype)
        return GatedMLP(c.hidden_size, c.intermediate_size, dtype)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        if isinstance(mlp, SparseMoeBlock):
            load_moe_block(mlp, src, p + "feed_forward.", router_name="router.")
        else:
            mlp.load(src, p + "feed_forward.")
