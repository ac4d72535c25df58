"""Phi3ForCausalLM: a Llama-style pre-norm decoder whose checkpoints fuse the projections.

qkv_proj stores [q | k | v] and gate_up_proj [gate | up] as single tensors; the attention and MLP modules split
them at load time into the per-head tensor-parallel layout (each rank reads only its rows of each part). RoPE may
be LongRoPE ("longrope", formerly "su": short/long factors and an attention factor, see layers.rotary for when the
long factors apply) and may rotate only part of each head (partial_rotary_factor). A config with sliding_window
windows every layer, and then blocks that slid out of the window are freed.
"""

from __future__ import annotations

from shoal.engine.execution.models.decoder import DecoderLM


class Phi3ForCausalLM(DecoderLM):
    pass
