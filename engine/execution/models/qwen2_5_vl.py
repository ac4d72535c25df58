"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a windowed ViT whose 2x2 patch merger makes
decoder-width image features, in front of a Qwen2 decoder that rotates by M-RoPE; and Qwen2-VL
(Qwen2VLForConditionalGeneration), the same over its own ViT (full attention, LayerNorm and QuickGELU blocks).

The decoder is Shoal's Qwen2 (llama.py: q/k/v biases, paged KV); this module adds
- `encode_images(images)`: transformers' own vision module for the config's vision_config (read with the checkpoint's
  visual.* / model.visual.* weights), run once per image outside the paged loop; the merger output is the image's
  features, which the runner puts in place of the image's <|image_pad|> tokens (runner.ModelRunner._embed_images);
- M-RoPE (`MRotaryEmbedding`): a step whose rows include image tokens brings positions [3, T] (temporal, height,
  width; core.images.PromptImages computes them once per prompt as transformers' get_rope_index does), and
  rope_parameters.mrope_section splits each head's rotary frequencies among the three. Every other step brings plain
  positions [T] (text, decode: the three are equal, so M-RoPE is plain RoPE) and takes the ordinary path, captured
  decode graphs included.

Checkpoints keep the decoder under model. (or model.language_model.), the LM head at lm_head., the tower under
visual. (or model.visual.).
"""

from __future__ import annotations

import torch

from shoal.engine.execution.layers.rotary import RotaryEmbedding, rope_parameters
from shoal.engine.execution.models.decoder import FULL, SLIDING
from shoal.engine.execution.models.llama import LlamaForCausalLM
from shoal.engine.execution.weights import WeightError

_VISION_PREFIXES = ("visual.", "model.visual.")


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequencies are shared among three position sets by rope_parameters.mrope_section (over half the
    head): in consecutive parts, part i rotated by set i % 3 (Qwen2.5-VL: Qwen2_5_VLRotaryEmbedding), or interleaved
    (Qwen3-VL: Qwen3VLTextRotaryEmbedding, frequency j by height where j % 3 == 1 and j < 3 * section[1], by width
    where j % 3 == 2 and j < 3 * section[2], else temporal). Positions [T] rotate as plain RoPE. Partial rotary
    (Qwen3.5: partial_rotary_factor) shares the rotated part's frequencies the same way."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, interleaved: bool = False):
        super().__init__(config, head_dim, max_positions, dtype)
        section, n = list(rope_parameters(config).get("mrope_section") or []), self.rotary_dim // 2
        if len(section) != 3 or sum(section) != n:
            raise ValueError(f"rope_parameters.mrope_section {section} must split the {n} rotary frequencies of a "
                             f"head of {head_dim} (rotary dimension {self.rotary_dim}) in 3")
        if interleaved:
            j = torch.arange(n)
            half = torch.zeros(n, dtype=torch.int64)
            half[(j % 3 == 1) & (j < 3 * section[1])] = 1
            half[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:
            half = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section)])
        self.register_buffer("section", torch.cat([half, half]), persistent=False)  # tables are [freqs, freqs]
        self._step = None  # (positions [3, T], rows, cos, sin) of the last 3-D step: its layers share one table

    def rotate_(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> None:
        if positions.dim() == 1:
            return super().rotate_(positions, qkv, heads)
        if self._step is None or self._step[0] is not positions:  # a step's positions are a new tensor, never edited
            # each row's own table: dimension d's cos/sin from position set section[d] (three gathered into one)
            pick = self.section.view(1, 1, -1).expand(1, positions.shape[1], -1)
            self._step = (positions, torch.arange(positions.shape[1], device=positions.device),
                          self.cos[positions].gather(0, pick)[0], self.sin[positions].gather(0, pick)[0])
        _, rows, cos, sin = self._step
        self._rotate(qkv, rows, cos, sin, heads)


def load_module(module: torch.nn.Module, src, prefixes: tuple[str, ...]) -> None:
    """A transformers module's parameters (and the buffers the checkpoint has) from the first prefix that holds
    them; WeightError naming the first missing tensor."""
    params = [n for n, _ in module.named_parameters()]
    prefix = next((p for p in prefixes if src.has(p + params[0])), prefixes[0])
    missing = [n for n in params if not src.has(prefix + n)]
    if missing:
        raise WeightError(f"{src.model_dir}: tensor {prefix + missing[0]!r} is missing from the checkpoint")
    state = {n: src.load(prefix + n, tuple(t.shape)) for n, t in module.state_dict().items() if src.has(prefix + n)}
    module.load_state_dict(state, strict=False)


class QwenVisionLanguage:
    """What a Qwen vision-language family adds to its decoder (mixed in before the decoder's class): the wrapper's
    vision tower (`vision_module`, transformers' own, for the config's vision_config) read from the checkpoint's
    `vision_prefixes`, encode_images over it, and M-RoPE (interleaved where `interleaved_mrope`)."""

    accepts_images = True
    prefixes = ("model.language_model.", "model.")
    vision_prefixes = _VISION_PREFIXES
    interleaved_mrope = False

    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        from transformers import AutoConfig

        full = AutoConfig.for_model(**config.vl_config)  # the wrapper's config, kept as a dict
        self.vision_dtype = dtype
        self.merge = full.vision_config.spatial_merge_size
        self.visual = self.vision_module(full.vision_config).to(dtype).eval()

    @staticmethod
    def vision_module(vision_config) -> torch.nn.Module:
        """transformers' Qwen2.5-VL (or Qwen2-VL) vision transformer for `vision_config` (its own class, attention and
        merger)."""
        if vision_config.model_type in ("qwen2_vl_vision", "qwen2_vl"):  # (older configs: the wrapper's model_type)
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as cls)
        return cls._from_config(vision_config)

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict:
        shared = MRotaryEmbedding(config, self.head_dim, max_model_len, dtype, interleaved=self.interleaved_mrope)
        return {SLIDING: shared, FULL: shared}

    def run_tower(self, images: list):
        """(the tower's output, grid [images, 3]) for images: StepImages with pixel_values [patches, C*t*p*p] and
        grid_thw. The images run through the tower together: its attention never crosses an image (cu_seqlens)."""
        pixels = torch.cat([image.pixel_values for image in images]).to(self.vision_dtype)
        grid = torch.tensor([image.grid_thw for image in images], dtype=torch.int64, device=pixels.device)
        return self.visual(pixels, grid_thw=grid), grid

    @torch.inference_mode()
    def encode_images(self, images: list) -> list[torch.Tensor]:
        """Each image's [num_tokens, hidden] features: the merger's output."""
        out, grid = self.run_tower(images)
        return list(out.pooler_output.split((grid.prod(-1) // self.merge ** 2).tolist()))

    def load_weights(self, src) -> None:
        super().load_weights(src)
        load_module(self.visual, src, self.vision_prefixes)


class Qwen2_5_VLForConditionalGeneration(QwenVisionLanguage, LlamaForCausalLM):
    def attention_options(self, layer_idx: int) -> dict:
        return {**super().attention_options(layer_idx), "qkv_bias": True, "o_bias": False}  # Qwen2's biases


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: Qwen2.5-VL's decoder, positions and checkpoint names over Qwen2-VL's vision transformer
    (vision_module picks it from the vision config)."""
