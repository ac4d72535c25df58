"""Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.

RoPE, grouped-query attention (QKV bias for Qwen2, q/k/v/o bias where a Llama config sets attention_bias), SwiGLU
MLP (with bias where mlp_bias is set), RMSNorm, tied or untied LM head. Mistral's sliding_window windows every
layer; Qwen2's layer_types window the layers past max_window_layers when use_sliding_window is on.
"""

from __future__ import annotations

from shoal.engine.execution.models.decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    def attention_options(self, layer_idx: int) -> dict:
        options = super().attention_options(layer_idx)
        if self.config.model_type == "qwen2":  # Qwen2 always has q/k/v biases (and none on o_proj)
            options["qkv_bias"] = True
        return options
