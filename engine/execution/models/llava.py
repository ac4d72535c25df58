"""LLaVA (transformers' LlavaForConditionalGeneration): a vision tower, a two-layer projector, and a text decoder
Shoal already serves.

The decoder is the text family's own class (paged KV, Shoal's forward pass); this module adds what turns an image
into decoder-width features: `encode_images(pixel_values)` runs the vision tower (transformers' module for the
config's vision_config — CLIP or SigLIP — with the checkpoint's weights: it runs once per image, outside the paged
decode loop) and the projector (our own), and keeps the features of the configured layer the way transformers
does (vision_feature_layer, vision_feature_select_strategy "default" drops the CLS feature). The runner puts those
features in place of the image placeholder tokens' embeddings (runner.ModelRunner._embed_images).

Checkpoints keep the decoder under language_model.model. (or model.language_model.), its LM head at
language_model.lm_head. (or lm_head.), the tower under vision_tower. (or model.vision_tower.) and the projector
under multi_modal_projector. (or model.multi_modal_projector.): `_DecoderView` shows the decoder its own names.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from shoal.engine.execution.weights import WeightError

_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
_HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight")
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class _DecoderView:
    """A weight source that names the decoder's tensors as a plain causal LM's checkpoint would (model.*,
    lm_head.weight)."""

    def __init__(self, src):
        self.src = src
        self.model_dir = src.model_dir
        self.threads = getattr(src, "threads", 1)
        self.prefix = _first(src, [p + "norm.weight" for p in _DECODER_PREFIXES]).removesuffix("norm.weight")
        self.head = next((h for h in _HEAD_NAMES if src.has(h)), _HEAD_NAMES[0])

    def _name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name.removeprefix("model.")

    def has(self, name: str) -> bool:
        return name.startswith("model.") and self.src.has(self._name(name))

    def shape(self, name: str):
        return self.src.shape(self._name(name))

    def load(self, name: str, *args, **kwargs) -> torch.Tensor:
        return self.src.load(self._name(name), *args, **kwargs)


def _first(src, names: list[str]) -> str:
    for name in names:
        if src.has(name):
            return name
    raise WeightError(f"{src.model_dir}: tensor {names[0]!r} is missing from the checkpoint")


class Projector(nn.Module):
    """linear_1, activation, linear_2 (transformers' LlavaMultiModalProjector)."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        from transformers.activations import ACT2FN

        layers = config.vision_feature_layer
        width = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        hidden, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(width, hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


@lru_cache(maxsize=None)
def vision_language(decoder_cls: type) -> type:
    """The LLaVA model over `decoder_cls` (a DecoderLM family); one class per family."""

    class Llava(decoder_cls):
        accepts_images = True

        def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
            super().__init__(config, dtype, backend, max_model_len, layer_partition)
            from transformers import AutoConfig, AutoModel

            full = AutoConfig.for_model(**config.vl_config)  # the wrapper's config, kept as a dict
            self.llava = full
            self.vision_dtype = dtype
            self.vision_tower = self.multi_modal_projector = None
            if self.ps.is_first_stage:  # later pipeline stages get the embeddings, image features in place, sent on
                self.vision_tower = AutoModel.from_config(full.vision_config, dtype=dtype)
                self.multi_modal_projector = Projector(full, dtype)

        @torch.inference_mode()
        def encode_images(self, images: list) -> list[torch.Tensor]:
            """Each image's [num_image_tokens, hidden] decoder-width features (images: StepImages, pixel_values
            [1, C, H, W]); images of one pixel shape run through the tower as one batch."""
            by_shape: dict[tuple, list[int]] = {}
            for i, image in enumerate(images):
                by_shape.setdefault(tuple(image.pixel_values.shape), []).append(i)
            out: list = [None] * len(images)
            for idx in by_shape.values():
                features = self._encode(torch.cat([images[i].pixel_values for i in idx]))
                for i, f in zip(idx, features):
                    out[i] = f
            return out

        def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
            """[B, num_image_tokens, hidden] features of a batch of images of one size ([B, C, H, W])."""
            c = self.llava
            out = self.vision_tower(pixel_values.to(self.vision_dtype), output_hidden_states=True, return_dict=True)
            layers = c.vision_feature_layer
            picked = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
            if c.vision_feature_select_strategy == "default":
                picked = [h[:, 1:] for h in picked]
            return self.multi_modal_projector(torch.cat(picked, dim=-1))

        def load_weights(self, src) -> None:
            super().load_weights(_DecoderView(src))
            for module, prefixes in ((self.vision_tower, _VISION_PREFIXES),
                                     (self.multi_modal_projector, _PROJECTOR_PREFIXES)):
                if module is None:
                    continue
                params = [n for n, _ in module.named_parameters()]
                prefix = next((p for p in prefixes if src.has(p + params[0])), prefixes[0])
                missing = [n for n in params if not src.has(prefix + n)]
                if missing:
                    raise WeightError(f"{src.model_dir}: tensor {prefix + missing[0]!r} is missing from the checkpoint")
                # buffers (CLIP's position_ids) are loaded where the checkpoint has them, else keep their value
                state = {n: src.load(prefix + n, tuple(t.shape)) for n, t in module.state_dict().items()
                         if src.has(prefix + n)}
                module.load_state_dict(state, strict=False)

    Llava.__name__ = Llava.__qualname__ = f"Llava{decoder_cls.__name__}"
    return Llava
