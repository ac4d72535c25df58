"""Qwen3.5's vision-language checkpoints (transformers' Qwen3_5ForConditionalGeneration, dense, and
Qwen3_5MoeForConditionalGeneration: how the releases ship): Qwen3-VL's scheme (qwen3_vl.py: the ViT with learned
position embeddings resampled to each grid, its 2x2 merger's features in place of <|image_pad|>, interleaved M-RoPE
positions computed once per prompt as get_rope_index does) without deepstack, over Qwen3.5's hybrid decoder
(qwen3_5.py: Gated DeltaNet layers 3:1 with gated attention). Its RoPE is partial (partial_rotary_factor): the
mrope_section splits the rotated part's frequencies. The Gated DeltaNet layers take no positions, so image rows
differ from text rows only in their embeddings and their attention layers' rotations.

The tower is transformers' Qwen3_5VisionModel (Qwen3_5MoeVisionModel: the same module), read from model.visual.;
the decoder from model.language_model.; the MTP head (mtp.) is never read. A checkpoint without its image
processor is served as its text decoder (models/__init__.text_decoder_config).
"""

from __future__ import annotations

import torch

from shoal.engine.execution.models.qwen2_5_vl import QwenVisionLanguage
from shoal.engine.execution.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3_5ForConditionalGeneration(QwenVisionLanguage, Qwen3_5ForCausalLM):
    vision_prefixes = ("model.visual.", "visual.")
    interleaved_mrope = True

    @staticmethod
    def vision_module(vision_config) -> torch.nn.Module:
        from transformers import AutoModel

        return AutoModel.from_config(vision_config)  # by its model_type: qwen3_5_vision, qwen3_5_moe_vision
