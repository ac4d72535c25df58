"""Qwen3ForCausalLM: the Llama-style decoder with RMSNorm on each query and key head (over head_dim, before RoPE),
no QKV bias, and head_dim taken from the config (not hidden_size / num_heads)."""

from __future__ import annotations

from shoal.engine.execution.models.decoder import RotaryDecoderLM


class Qwen3ForCausalLM(RotaryDecoderLM):
    qk_norm = "head"
