"""Qwen3ForCausalLM: the Llama-style decoder with RMSNorm on each query and key head (over head_dim, before RoPE),
no QKV bias, and head_dim taken from the config (not hidden_size / num_heads)."""

from __future__ import annotations

from shoal.engine.execution.models.decoder import DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    qk_norm = "head"
