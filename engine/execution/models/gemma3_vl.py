"""Gemma 3 vision-language (transformers' Gemma3ForConditionalGeneration): a SigLIP vision tower and Gemma 3's
multi-modal projector in front of Shoal's Gemma 3 decoder (sliding and global layers, paged KV).

- `encode_images(images)`: transformers' vision module for the config's vision_config (SigLIP) with the checkpoint's
  weights, its last hidden state through transformers' own Gemma3MultiModalProjector (average-pooled to
  mm_tokens_per_image, soft-embedding RMSNorm, projection), as Gemma3Model.get_image_features computes them. The
  runner puts them in place of the <image_soft_token> embeddings; like transformers, the features are not scaled
  by sqrt(hidden) (only the text embeddings are, in the decoder's embed).
- Bidirectional image attention: a step that prefills image tokens carries their spans (StepInputs.image_spans,
  from core/images.Gemma3ImageInputs), and attention/layer.py runs it through SDPA with the mask OR(causal, same
  image), AND each sliding layer's window, as transformers' create_masks_for_vision_model; every other step keeps
  the configured kernels and the captured decode graphs.
- Tensor and pipeline parallelism: the spans travel to every rank with the step's plan (each rank's SDPA masks its
  own query heads), pipeline micro-batches carry their sequences' spans (a micro-batch holds whole sequences, so
  never part of an image), and only the first stage builds and loads the tower and projector.

Checkpoints keep the decoder under language_model.model. (or model.language_model.), the tower under vision_tower.
(optionally .vision_model.; or model.vision_tower.), the projector under multi_modal_projector. (or
model.multi_modal_projector.); the LM head is tied to the embeddings.
"""

from __future__ import annotations

import torch

from shoal.engine.execution.models.gemma3 import Gemma3ForCausalLM
from shoal.engine.execution.models.llava import _DecoderView
from shoal.engine.execution.models.qwen2_5_vl import load_module

_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "vision_tower.vision_model.",
                    "model.vision_tower.vision_model.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    accepts_images = True

    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        from transformers import AutoConfig, AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        full = AutoConfig.for_model(**config.vl_config)  # the wrapper's config, kept as a dict
        self.vision_dtype = dtype
        self.vision_tower = self.multi_modal_projector = None
        if self.ps.is_first_stage:  # later pipeline stages get the embeddings, image features in place, sent on
            self.vision_tower = AutoModel.from_config(full.vision_config, dtype=dtype).eval()
            self.multi_modal_projector = Gemma3MultiModalProjector(full).to(dtype).eval()

    @torch.inference_mode()
    def encode_images(self, images: list) -> list[torch.Tensor]:
        """Each image's [mm_tokens_per_image, hidden] features (images: StepImages, pixel_values [1, C, H, W], one
        size for the checkpoint): one batch through the tower."""
        pixels = torch.cat([image.pixel_values for image in images]).to(self.vision_dtype)
        hidden = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(hidden))

    def load_weights(self, src) -> None:
        super().load_weights(_DecoderView(src))
        if self.vision_tower is not None:
            load_module(self.vision_tower, src, _VISION_PREFIXES)
            load_module(self.multi_modal_projector, src, _PROJECTOR_PREFIXES)
