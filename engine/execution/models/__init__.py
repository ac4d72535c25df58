"""Model registry keyed by the `architectures` entry of a Hugging Face config."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry itself is importable without torch (the CLI's --help lists it)
    from shoal.engine.execution.models.base import CausalLM

_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "BloomForCausalLM": ("bloom", "BloomForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("moe", "OlmoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("deepseek", "Glm4MoeLiteForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),  # the MLP is the config's: dense or sparse
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
    "BertModel": ("bert", "BertModel"),  # encoder-only: embeddings only
}

# Vision-language checkpoints served as their text decoder (the vision tower never read; requests text only) when the
# checkpoint has no image processor: the wrapper's architecture -> the decoder's, built from the wrapper's
# text_config. With one, they are _VISION_LANGUAGE families.
_TEXT_DECODERS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

# LLaVA-style checkpoints (models/llava.py): a vision tower and projector in front of a decoder family served here,
# named by the text_config's model_type.
_LLAVA = "LlavaForConditionalGeneration"
_LLAVA_DECODERS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Vision-language families with their own model module (the vision tower, M-RoPE) over a decoder served here:
# the wrapper's architecture -> (module, class, the decoder's architecture).
_VISION_LANGUAGE = {
    "Qwen2VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2VLForConditionalGeneration", "Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM"),
    # Qwen3.5: Qwen3-VL's tower (no deepstack) over the hybrid Gated DeltaNet decoder, dense or MoE
    "Qwen3_5ForConditionalGeneration": ("qwen3_5_vl", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_vl", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    # Gemma 3: a SigLIP tower and its projector; image tokens attend bidirectionally within their image
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = sorted({*_REGISTRY, *_TEXT_DECODERS, _LLAVA, *_VISION_LANGUAGE})


def text_decoder_config(config, image_processor: bool = True):
    """`config` itself, or for a vision-language checkpoint its text_config made a causal LM's: the decoder's
    architecture, and the wrapper's tie_word_embeddings and dtype (what the wrapper's own class follows), with the
    vision-language family where the model takes images. `image_processor`: whether the checkpoint has one (a
    _TEXT_DECODERS checkpoint without it is served text only)."""
    archs = getattr(config, "architectures", None) or []
    if _LLAVA in archs:
        return _llava_text_config(config)
    family = next((a for a in archs if a in _VISION_LANGUAGE and (image_processor or a not in _TEXT_DECODERS)), None)
    if family is not None:
        return _vision_language_text_config(config, family, _VISION_LANGUAGE[family][2])
    decoder = next((_TEXT_DECODERS[a] for a in archs if a in _TEXT_DECODERS), None)
    if decoder is None:
        return config
    text = config.text_config  # transformers fills in its defaults where config.json has none
    text.architectures = [decoder]
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text


def _llava_text_config(config):
    """A LLaVA checkpoint's text_config as its decoder's (the text_config's model_type names it)."""
    text = config.text_config
    decoder = _LLAVA_DECODERS.get(text.model_type)
    if decoder is None:
        raise ValueError(f"LLaVA with a {text.model_type!r} decoder is not supported; supported decoders: "
                         f"{', '.join(sorted(_LLAVA_DECODERS))}")
    return _vision_language_text_config(config, _LLAVA, decoder)


def _vision_language_text_config(config, family: str, decoder: str):
    """A vision-language checkpoint's text_config as its decoder's (`decoder`'s architecture), carrying the family
    (`vl_family`: the wrapper's architecture), the whole wrapper config as a plain dict (`vl_config`, what the
    family's module builds the vision tower from) and the image token's id."""
    text = config.text_config
    text.architectures = [decoder]
    text.vl_family = family
    text.vl_config = config.to_dict()
    text.image_token_id = config.image_token_id
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text


def accepts_images(config) -> bool:
    """Whether the served model takes images (a vision-language checkpoint whose vision tower is served)."""
    return getattr(config, "vl_config", None) is not None


def model_class(config) -> type[CausalLM]:
    import importlib

    archs = getattr(config, "architectures", None) or []
    if accepts_images(config):  # imported by name: this registry stays importable without torch
        family = getattr(config, "vl_family", _LLAVA)
        if family in _VISION_LANGUAGE:
            module, cls, _ = _VISION_LANGUAGE[family]
            return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
        return importlib.import_module(f"{__name__}.llava").vision_language(_decoder_class(archs))
    return _decoder_class(archs)


def _decoder_class(archs: list[str]) -> type[CausalLM]:
    import importlib

    for arch in archs:
        if arch in _REGISTRY:
            module, cls = _REGISTRY[arch]
            return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    raise ValueError(
        f"unsupported architecture {archs or '(config.json has no architectures)'}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
