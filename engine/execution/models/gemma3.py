"""Gemma3ForCausalLM (the text model, config type gemma3_text): Gemma 2's layer with per-head q/k RMSNorm.

Layer types come from config.layer_types (by default five sliding-window layers to one global,
sliding_window_pattern). Sliding layers use RoPE with rope_local_base_freq and no scaling; global layers use
rope_theta with the configured scaling (e.g. linear for the long-context checkpoints). Attention-logit
soft-capping is gone (query_pre_attn_scalar still scales); final-logit soft-capping applies when configured.
"""

from __future__ import annotations

from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.decoder import FULL, SLIDING
from shoal.engine.execution.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"

    @classmethod
    def default_layer_types(cls, config) -> list[str]:
        pattern = getattr(config, "sliding_window_pattern", 6)
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict[str, RotaryEmbedding]:
        params = getattr(config, "rope_parameters", None) or {}
        if SLIDING in params or FULL in params:  # transformers >= 5: one parameter set per layer type
            return {t: RotaryEmbedding(config, self.head_dim, max_model_len, dtype, layer_type=t)
                    for t in (SLIDING, FULL)}
        raise ValueError("Gemma 3 config has no per-layer-type rope_parameters (transformers >= 5 writes them for "
                         "every gemma3_text config it loads); cannot tell local from global RoPE")
