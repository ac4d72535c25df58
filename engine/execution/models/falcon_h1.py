"""FalconH1ForCausalLM (Falcon-H1): every layer runs attention and a Mamba2 mixer side by side on the same normed
input and adds both outputs, then a gated MLP; muP multipliers throughout.

- Each layer holds a KV cache and a Mamba state slot (models/hybrid.LayerCaches).
- Mamba2 (layers/mamba2.py): intermediate mamba_d_ssm (or mamba_expand x hidden), its norm by mamba_rms_norm and
  mamba_norm_before_gate (none: y * SiLU(z)).
- The multipliers, folded into the weights at load where they scale a projection: in_proj's input by
  ssm_in_multiplier and its z/x/B/C/dt rows by ssm_multipliers, out_proj by ssm_out_multiplier; the attention's
  input by attention_in_multiplier (q, k and v), its keys by key_multiplier, its output by attention_out_multiplier;
  the MLP's gate by mlp_multipliers[0] and its down projection by mlp_multipliers[1]. Embeddings are multiplied by
  embedding_multiplier and logits by lm_head_multiplier at run time.
- Biases (attention_bias, mlp_bias, mamba_proj_bias, projectors_bias) are refused at load: the releases have none,
  and a bias does not fold with the multipliers the way its weight does.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.attention_block import RotaryAttention
from shoal.engine.execution.layers.mamba2 import Mamba2Mixer, Mamba2Shape, scaled
from shoal.engine.execution.layers.mlp import GatedMLP
from shoal.engine.execution.models.base import reader
from shoal.engine.execution.models.decoder import FULL, DecoderLayer, DecoderLM
from shoal.engine.execution.models.hybrid import HybridCaches


class ParallelMixers(nn.Module):
    """Attention and Mamba2 on the same input, outputs summed. Seen by the hybrid caches as both an attention
    mixer (`attn`) and a recurrent one (`allocate_state`)."""

    def __init__(self, attention: RotaryAttention, mamba: Mamba2Mixer):
        super().__init__()
        self.attention, self.mamba = attention, mamba

    @property
    def attn(self):
        return self.attention.attn

    def state_bytes(self) -> int:
        return self.mamba.state_bytes()

    def allocate_state(self, slots: int, device):
        return self.mamba.allocate_state(slots, device)

    def forward(self, h, positions, caches, meta):
        out = self.mamba(h, positions, caches.state, meta)
        return out + self.attention(h, positions, caches.kv, meta)

    def load(self, src, p: str) -> None:
        self.mamba.load(src, p + "mamba.")
        self.attention.load(src, p + "self_attn.")


class MultipliedAttention(RotaryAttention):
    """RotaryAttention whose q/k/v/o weights carry Falcon-H1's attention multipliers (folded at load)."""

    def __init__(self, *args, multipliers: tuple[float, float, float], **kwargs):
        super().__init__(*args, **kwargs)
        self.multipliers = multipliers  # (input, key, output)

    def load(self, src, a: str) -> None:
        h, hd, nh, nkv = self.hidden, self.head_dim, self.total_heads, self.total_kv_heads
        inp, key, out = self.multipliers
        self.qkv_proj.load([scaled(reader(src, a + "q_proj.weight", (nh * hd, h)), inp),
                            scaled(reader(src, a + "k_proj.weight", (nkv * hd, h)), inp * key),
                            scaled(reader(src, a + "v_proj.weight", (nkv * hd, h)), inp)])
        self.o_proj.load(scaled(reader(src, a + "o_proj.weight", (h, nh * hd)), out))


class FalconH1Layer(DecoderLayer):
    norm_names = ("input_layernorm", "pre_ff_layernorm")

    def __init__(self, self_attn, mlp, hidden, eps, dtype, norm_cls):
        super().__init__(self_attn, mlp, hidden, eps, dtype, norm_cls)
        self.pre_ff_layernorm = self.post_attention_layernorm
        del self.post_attention_layernorm

    def forward(self, x, positions, cache, meta, delta=None):
        mixed = self.self_attn(self.input_layernorm.add_and_norm(x, delta), positions, cache, meta)
        return x, self.mlp(self.pre_ff_layernorm.add_and_norm(x, mixed))


class FalconH1ForCausalLM(HybridCaches, DecoderLM):
    layer_cls = FalconH1Layer

    def __init__(self, config, dtype, backend, max_model_len, layer_partition=None):
        c = config
        for name in ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"):
            if getattr(c, name, False):
                raise ValueError(f"Falcon-H1 config: {name}=true is not supported (the releases have none)")
        if c.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Falcon-H1 config: hidden_act {c.hidden_act!r} is not supported (silu)")
        inner = c.mamba_d_ssm if c.mamba_d_ssm is not None else c.mamba_expand * c.hidden_size
        if c.mamba_n_heads * c.mamba_d_head != inner:
            raise ValueError(f"Falcon-H1 config: mamba_n_heads ({c.mamba_n_heads}) x mamba_d_head ({c.mamba_d_head}) "
                             f"must equal mamba_d_ssm ({inner})")
        if c.mamba_n_heads % c.mamba_n_groups:
            raise ValueError(f"Falcon-H1 config: mamba_n_groups ({c.mamba_n_groups}) must divide mamba_n_heads "
                             f"({c.mamba_n_heads})")
        ssm = [float(m) for m in c.ssm_multipliers]
        if len(ssm) != 5:
            raise ValueError(f"Falcon-H1 config: ssm_multipliers {c.ssm_multipliers} must give 5 values (z, x, B, C, dt)")
        if len(c.mlp_multipliers) != 2:
            raise ValueError(f"Falcon-H1 config: mlp_multipliers {c.mlp_multipliers} must give 2 values (gate, down)")
        norm = ("gate_only" if not c.mamba_rms_norm else "norm_then_gate" if c.mamba_norm_before_gate else "gated")
        limit = tuple(c.time_step_limit or (0.0, float("inf")))
        self.mamba_shape = Mamba2Shape(
            hidden=c.hidden_size, heads=c.mamba_n_heads, head_dim=c.mamba_d_head, groups=c.mamba_n_groups,
            d_state=c.mamba_d_state, conv_kernel=c.mamba_d_conv, conv_bias=bool(c.mamba_conv_bias), proj_bias=False,
            eps=c.rms_norm_eps, norm_groups=c.mamba_n_groups, time_step_limit=(float(limit[0]), float(limit[1])),
            norm=norm, in_multipliers=tuple(m * float(c.ssm_in_multiplier) for m in ssm),
            out_multiplier=float(c.ssm_out_multiplier))
        super().__init__(config, dtype, backend, max_model_len, layer_partition)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        return [FULL] * config.num_hidden_layers

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_mixer(self, layer_idx, layer_type, window, rotaries, dtype, backend) -> nn.Module:
        c = self.config
        attention = MultipliedAttention(c, dtype, backend, rotaries[FULL], self.head_dim, multipliers=(
            float(c.attention_in_multiplier), float(c.key_multiplier), float(c.attention_out_multiplier)))
        return ParallelMixers(attention, Mamba2Mixer(self.mamba_shape, dtype))

    def mixer_prefix(self, layer_idx: int) -> str:
        return ""  # ParallelMixers.load finds mamba. and self_attn. under the layer

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, dtype)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        c = self.config
        h, inter = c.hidden_size, c.intermediate_size
        gate, down = (float(m) for m in c.mlp_multipliers)
        m = p + "feed_forward."
        mlp.gate_up_proj.load([scaled(reader(src, m + "gate_proj.weight", (inter, h)), gate),
                               reader(src, m + "up_proj.weight", (inter, h))])
        mlp.down_proj.load(scaled(reader(src, m + "down_proj.weight", (h, inter)), down))

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.config.lm_head_multiplier

    def load_weights(self, src) -> None:
        # The final norm is final_layernorm; the decoder base reads `norm`: alias it for the load.
        alias = _Renamed(src, {"model.norm.weight": "model.final_layernorm.weight",
                               "norm.weight": "final_layernorm.weight"})
        super().load_weights(alias)


class _Renamed:
    """A WeightSource that answers a few names from others."""

    def __init__(self, src, names: dict[str, str]):
        self._src, self._names = src, names

    def __getattr__(self, attr):
        return getattr(self._src, attr)

    def has(self, name: str) -> bool:
        return self._src.has(self._names.get(name, name))

    def load(self, name: str, *args, **kwargs):
        return self._src.load(self._names.get(name, name), *args, **kwargs)
