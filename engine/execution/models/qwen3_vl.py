"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): Qwen2.5-VL's scheme (qwen2_5_vl.py: patches and grid,
the merger's features in place of <|image_pad|>, M-RoPE positions computed once per prompt) with
- the vision transformer Qwen3VLVisionModel (learned position embeddings resampled to each grid, full attention),
- interleaved M-RoPE (MRotaryEmbedding(interleaved=True)) over Shoal's Qwen3 decoder (q/k head norms),
- deepstack: the tower's deepstack mergers (deepstack_visual_indexes) give one more feature per image token for each
  of the decoder's first layers, added to the residual stream of the image's rows after that layer.

encode_images returns each image's features and its deepstack features side by side ([tokens, hidden * (1 + k)]),
so the encoder cache and the chunk slicing keep them together; the runner puts the first `hidden` in the embeddings
and hands the rest to the next forward (`self.deepstack`: the rows and their [rows, k * hidden] features). A step
without image rows runs the plain decoder forward (decode graphs included).

Checkpoints keep the decoder under model.language_model. (or model.), the LM head at lm_head., the tower under
model.visual. (or visual.).
"""

from __future__ import annotations

import torch

from shoal.engine.execution.models.qwen2_5_vl import QwenVisionLanguage
from shoal.engine.execution.models.qwen3 import Qwen3ForCausalLM


class Qwen3VLForConditionalGeneration(QwenVisionLanguage, Qwen3ForCausalLM):
    vision_prefixes = ("model.visual.", "visual.")
    interleaved_mrope = True

    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        self.deepstack = None  # this step's image rows and their deepstack features (set by the runner)

    @staticmethod
    def vision_module(vision_config) -> torch.nn.Module:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel._from_config(vision_config)

    @torch.inference_mode()
    def encode_images(self, images: list) -> list[torch.Tensor]:
        """Each image's [num_tokens, hidden * (1 + deepstack layers)] features: the merger's, then each deepstack
        merger's."""
        out, grid = self.run_tower(images)
        merged = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        return list(merged.split((grid.prod(-1) // self.merge ** 2).tolist()))

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        deep, self.deepstack = self.deepstack, None
        if deep is None:
            return super().forward(input_ids, positions, kv_caches, meta, hidden)
        rows, features = deep
        layers = features.chunk(features.shape[1] // self.config.hidden_size, dim=1)
        x, delta = hidden.clone(), None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, positions, kv_caches[i], meta, delta)
            if i < len(layers):  # the stream after layer i is x + delta: the image rows' features join it
                x.index_add_(0, rows, layers[i])
        return self.norm.add_and_norm(x, delta)
