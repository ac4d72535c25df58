"""NemotronHForCausalLM (Nemotron-H): a stack of single-mixer blocks, each x + mixer(RMSNorm(x)), the mixer one of
Mamba2 (layers/mamba2.py, its state in the hybrid caches), attention (grouped-query, no RoPE), or an ungated
squared-ReLU MLP, by config.layers_block_type (transformers turns the checkpoints' hybrid_override_pattern, e.g.
"M-M*-", into that list).

- The Mamba2 mixer: mamba_num_heads x mamba_head_dim, n_groups B/C groups (the gated norm's groups too),
  ssm_state_size, conv_kernel, use_conv_bias, use_bias on in_proj/out_proj, dt floored at time_step_min.
- Checkpoint names: backbone.embeddings, backbone.layers.{i}.norm / .mixer.*, backbone.norm_f, lm_head.
- "moe" blocks (Nemotron 3's ungated squared-ReLU experts with grouped sigmoid routing) are refused at load: the
  fused MoE layer runs gated experts only.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from shoal.engine.execution.layers.mlp import PlainMLP
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.models.base import find_prefix, reader
from shoal.engine.execution.models.decoder import FULL, DecoderLM
from shoal.engine.execution.models.granitemoehybrid import NoPositions
from shoal.engine.execution.models.hybrid import HybridCaches

MAMBA, MLP = "linear_attention", "mlp"
_NAMES = {"mamba": MAMBA, MAMBA: MAMBA, "attention": FULL, FULL: FULL, MLP: MLP}


class SingleMixerBlock(nn.Module):
    """x + mixer(norm(x)), the mixer Mamba2, attention or an MLP (kept as `self_attn`, where the hybrid caches
    look for a layer's mixer). Its output is added by the next block's norm, as DecoderLayer defers it."""

    norm_names = ("norm",)

    def __init__(self, mixer: nn.Module, mlp, hidden: int, eps: float, dtype: torch.dtype,
                 norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.norm = norm_cls(hidden, eps, dtype)
        self.self_attn = mixer
        self.takes_cache = not isinstance(mixer, PlainMLP)

    def forward(self, x, positions, cache, meta, delta=None):
        h = self.norm.add_and_norm(x, delta)
        return x, self.self_attn(h, positions, cache, meta) if self.takes_cache else self.self_attn(h)


class NemotronHForCausalLM(HybridCaches, DecoderLM):
    layer_cls = SingleMixerBlock
    prefixes = ("backbone.", "model.")

    def __init__(self, config, dtype, backend, max_model_len, layer_partition=None):
        c = config
        self.layer_types(c)
        if c.mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(f"Nemotron-H config: mamba_hidden_act {c.mamba_hidden_act!r} is not supported (silu)")
        if c.attention_bias:
            raise ValueError("Nemotron-H config: attention_bias=true is not supported (the releases have none)")
        if c.mamba_num_heads % c.n_groups:
            raise ValueError(f"Nemotron-H config: n_groups ({c.n_groups}) must divide mamba_num_heads "
                             f"({c.mamba_num_heads})")
        self.mamba_shape = Mamba2Shape(
            hidden=c.hidden_size, heads=c.mamba_num_heads, head_dim=c.mamba_head_dim, groups=c.n_groups,
            d_state=c.ssm_state_size, conv_kernel=c.conv_kernel, conv_bias=bool(c.use_conv_bias),
            proj_bias=bool(c.use_bias), eps=c.layer_norm_epsilon, norm_groups=c.n_groups,
            time_step_limit=(float(c.time_step_min), float("inf")))
        c.rms_norm_eps = c.layer_norm_epsilon  # the name the decoder base reads
        super().__init__(config, dtype, backend, max_model_len, layer_partition)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        types = list(getattr(config, "layers_block_type", None) or [])
        unknown = sorted(set(types) - set(_NAMES))
        if unknown or not types:
            raise ValueError(f"Nemotron-H config: layers_block_type {types} must give 'mamba', 'attention' or 'mlp' "
                             "for each layer" + (f"; unsupported layer type(s) {unknown}" if unknown else "")
                             + ("; 'moe' blocks (ungated experts) are not supported yet" if "moe" in unknown else ""))
        return [_NAMES[t] for t in types]

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return [None] * len(cls.layer_types(config))

    def make_rotaries(self, config, max_model_len, dtype) -> dict:
        return {FULL: NoPositions()}

    def make_mixer(self, layer_idx, layer_type, window, rotaries, dtype, backend) -> nn.Module:
        c = self.config
        if layer_type == MAMBA:
            return Mamba2Mixer(self.mamba_shape, dtype)
        if layer_type == MLP:
            return PlainMLP(c.hidden_size, c.intermediate_size, dtype, c.mlp_hidden_act, bool(c.mlp_bias))
        return RotaryAttention(c, dtype, backend, rotaries[FULL], self.head_dim)

    def make_mlp(self, layer_idx: int, dtype) -> None:
        return None  # the MLP is a block of its own

    def load_weights(self, src) -> None:
        c = self.config
        p = find_prefix(src, list(self.prefixes), "norm_f.weight")
        shape = (c.vocab_size, c.hidden_size)
        if self.ps.is_first_stage or (self.ps.is_last_stage and self.lm_head.tied):
            self.embed_tokens.load(reader(src, p + "embeddings.weight", shape))
        for i, layer in enumerate(self.layers):
            lp = f"{p}layers.{self.start_layer + i}."
            layer.norm.weight.data.copy_(src.load(lp + "norm.weight", (c.hidden_size,)))
            layer.self_attn.load(src, lp + "mixer.")
        if self.ps.is_last_stage:
            self.norm.weight.data.copy_(src.load(p + "norm_f.weight", (c.hidden_size,)))
            if not self.lm_head.tied:
                self.lm_head.load(reader(src, "lm_head.weight", shape))
