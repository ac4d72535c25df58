"""Attention backends over the paged KV cache, and the rule that picks one.

`auto` prefers, on CUDA: FlashAttention (when installed and the model has neither ALiBi nor attention sinks), then
the Triton paged
kernel, then SDPA; on CPU: the C++ paged kernel (compiled on first use), then SDPA. The Triton kernel runs on CPU
only under TRITON_INTERPRET=1, for tests. With --kv-cache-dtype fp8 only backends that read an fp8 cache
(`supports_fp8_kv`) are candidates.
"""

from __future__ import annotations

import importlib
import logging

import torch

from shoal.engine.execution.attention.base import AttentionBackend, AttentionMetadata, KVCache, write_kv

logger = logging.getLogger(__name__)

_BACKENDS = {
    "flash": ("flash_attn", "FlashAttentionBackend"),
    "triton": ("triton_attn", "TritonAttentionBackend"),
    "cpu": ("cpu_paged", "CpuPagedAttentionBackend"),
    "sdpa": ("sdpa", "SdpaBackend"),
}
_AUTO_ORDER = {"cuda": ["flash", "triton", "sdpa"], "cpu": ["cpu", "sdpa"]}


def backend_class(name: str) -> type[AttentionBackend] | None:
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    except (ImportError, AttributeError) as e:
        logger.debug("attention backend %s cannot be imported: %s", name, e)
        return None


def _usable(name: str, device: torch.device, uses_alibi: bool, model_shape: dict,
            kv_cache_dtype: str = "auto", uses_sinks: bool = False) -> tuple[bool, str]:
    cls = backend_class(name)
    if cls is None:
        return False, f"the {name} backend could not be imported"
    if uses_alibi and not cls.supports_alibi:
        return False, (f"the {name} attention backend does not support ALiBi models (e.g. BLOOM); "
                       "use --attention-backend triton, cpu or sdpa")
    if uses_sinks and not cls.supports_sinks:
        readers = " | ".join(n for n in _BACKENDS if (c := backend_class(n)) is not None and c.supports_sinks)
        return False, (f"the {name} attention backend cannot add attention sinks (gpt-oss models); "
                       f"use --attention-backend {readers}")
    if kv_cache_dtype == "fp8" and not cls.supports_fp8_kv:
        readers = " | ".join(n for n in _BACKENDS if (c := backend_class(n)) is not None and c.supports_fp8_kv)
        return False, (f"the {name} attention backend cannot read an fp8 KV cache (--kv-cache-dtype fp8): "
                       f"{cls.fp8_kv_refusal or 'it has no fp8 path'}; use --attention-backend {readers} "
                       "or --kv-cache-dtype auto")
    ok, why = cls.is_available(device)
    if ok and model_shape and hasattr(cls, "check_config"):
        ok, why = cls.check_config(uses_alibi=uses_alibi, **model_shape)
    return ok, why


def select_backend(choice: str, device: torch.device, uses_alibi: bool, kv_cache_dtype: str = "auto",
                   uses_sinks: bool = False, **model_shape) -> AttentionBackend:
    """The backend instance for --attention-backend `choice`; a clear ValueError when it cannot be used.
    model_shape: head_dim, dtype, block_size, num_heads, num_kv_heads — checked by backends that have limits;
    kv_cache_dtype "fp8" takes only backends that read an fp8 cache; uses_sinks only backends that add sinks."""
    if choice != "auto":
        if choice not in _BACKENDS:
            raise ValueError(f"unknown attention backend {choice!r}; choose from auto, {', '.join(_BACKENDS)}")
        ok, why = _usable(choice, device, uses_alibi, model_shape, kv_cache_dtype, uses_sinks)
        if not ok:
            raise ValueError(f"--attention-backend {choice} cannot be used: {why}")
        return backend_class(choice)()
    for name in _AUTO_ORDER.get(device.type, ["sdpa"]):
        ok, why = _usable(name, device, uses_alibi, model_shape, kv_cache_dtype, uses_sinks)
        if ok:
            logger.info("attention backend: %s (auto on %s%s)", name, device.type, ", ALiBi model" if uses_alibi else "")
            return backend_class(name)()
        logger.debug("attention backend %s skipped: %s", name, why)
    raise RuntimeError("no attention backend is usable")  # sdpa always is; kept for clarity


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "write_kv", "select_backend", "backend_class"]
