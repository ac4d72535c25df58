"""Shared fixtures: tiny random-weight Hugging Face models, one per supported architecture."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Triton fixes interpreted-vs-compiled at its first import (transformers imports it), so decide before that:
# without a GPU, Triton kernels run in the interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ["llama", "mistral", "qwen2", "bloom", "gpt2"]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, **config_overrides) -> directory; cached per distinct arguments for the session."""
    import transformers

    from shoal.engine.tools.tiny_model import make_model

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cache: dict = {}

    def make(arch: str = "llama", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_model(tmp_path_factory.mktemp(f"model-{arch}"), arch=arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=ARCHS)
def any_model(request, model_factory):
    """Each supported architecture in turn: (arch, model directory)."""
    return request.param, model_factory(request.param)


@pytest.fixture(scope="session")
def llama_model(model_factory):
    return model_factory("llama")

