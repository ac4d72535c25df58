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
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "BertModel": ("bert", "BertModel"),  # encoder-only: embeddings only
}

SUPPORTED_ARCHITECTURES = sorted(_REGISTRY)


def model_class(config) -> type[CausalLM]:
    import importlib

    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            module, cls = _REGISTRY[arch]
            return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    raise ValueError(
        f"unsupported architecture {archs or '(config.json has no architectures)'}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
