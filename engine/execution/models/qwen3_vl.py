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

from shoal.engine.execution.models.decoder import FULL, SLIDING
from shoal.engine.execution.models.qwen2_5_vl import MRotaryEmbedding, load_module
from shoal.engine.execution.models.qwen3 import Qwen3ForCausalLM

_VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    accepts_images = True
    prefixes = ("model.language_model.", "model.")

    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        from transformers import AutoConfig
        from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

        full = AutoConfig.for_model(**config.vl_config)  # the wrapper's config, kept as a dict
        self.vision_dtype = dtype
        self.merge = full.vision_config.spatial_merge_size
        self.visual = hf.Qwen3VLVisionModel._from_config(full.vision_config).to(dtype).eval()
        self.deepstack = None  # this step's image rows and their deepstack features (set by the runner)

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict:
        shared = MRotaryEmbedding(config, self.head_dim, max_model_len, dtype, interleaved=True)
        return {SLIDING: shared, FULL: shared}

    @torch.inference_mode()
    def encode_images(self, images: list) -> list[torch.Tensor]:
        """Each image's [num_tokens, hidden * (1 + deepstack layers)] features: the merger's, then each deepstack
        merger's (images: StepImages with pixel_values [patches, C*t*p*p] and grid_thw)."""
        pixels = torch.cat([image.pixel_values for image in images]).to(self.vision_dtype)
        grid = torch.tensor([image.grid_thw for image in images], dtype=torch.int64, device=pixels.device)
        out = self.visual(pixels, grid_thw=grid)
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

    def load_weights(self, src) -> None:
        super().load_weights(src)
        load_module(self.visual, src, _VISION_PREFIXES)
