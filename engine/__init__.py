"""Shoal's inference engine: paged KV cache, continuous batching, prefix caching, OpenAI-compatible server."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "PoolingParams", "EngineConfig", "LLMEngine", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import shoal.engine` (e.g. for the CLI's --help) does not pull in torch and transformers.
    if name == "LLM":
        from shoal.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "PoolingParams"):
        from shoal.engine import contracts

        return getattr(contracts, name)
    if name == "EngineConfig":
        from shoal.engine.config import EngineConfig

        return EngineConfig
    if name == "LLMEngine":
        from shoal.engine.core.engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from shoal.engine.core import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
