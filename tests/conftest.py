"""Shared fixtures: tiny random-weight Hugging Face models, one per supported architecture."""

from __future__ import annotations

import ast
import functools
import os
import sys
import threading

import pytest


def _serialise_ast_parse() -> None:
    """CPython 3.11.0-3.11.7 and 3.12.0-3.12.1 track the AST constructor's recursion depth in global state, so two
    threads in ast.parse at once can raise "SystemError: AST constructor recursion depth mismatch" (gh-106905,
    fixed in 3.11.8 / 3.12.2). Here the two are pytest's assertion rewriter and a background thread (kopf, the
    gateway, an engine loop) formatting a traceback, which parses the failing line on 3.11. One lock makes them safe;
    a thread that compiles source without ast.parse (a lazy import left running by an earlier test's background
    thread) still shares the counter, so a parse that meets one is run again: the error says only that the
    counter moved under it, and the source is unchanged."""
    if not ((3, 11) <= sys.version_info[:3] < (3, 11, 8) or (3, 12) <= sys.version_info[:3] < (3, 12, 2)):
        return
    lock, parse = threading.RLock(), ast.parse

    @functools.wraps(parse)
    def locked_parse(*args, **kwargs):
        with lock:
            for attempt in range(5):
                try:
                    return parse(*args, **kwargs)
                except SystemError as e:
                    if "recursion depth mismatch" not in str(e) or attempt == 4:
                        raise

    ast.parse = locked_parse


_serialise_ast_parse()
# Engines started by tests (in process and as subprocesses) save no CPU decode graphs into the user's cache: each
# test's model folder would leave an entry behind for good. The graph cache's own tests opt back in.
os.environ.setdefault("SHOAL_GRAPH_CACHE", "0")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Triton fixes interpreted-vs-compiled at its first import (transformers imports it), so decide before that:
# without a GPU, Triton kernels run in the interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ["llama", "mistral", "qwen2", "bloom", "gpt2", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, **config_overrides) -> directory; cached per distinct arguments for the session."""
    import transformers

    from shoal.engine.tools.tiny_model import make_model

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cache: dict = {}

    def make(arch: str = "llama", **kw):
        key = (arch, repr(sorted(kw.items())))  # repr: list-valued overrides (layer_types) too
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


@pytest.fixture(scope="session")
def llava_model(tmp_path_factory):
    """A tiny LLaVA (CLIP tower, projector, Llama decoder) with its processor; 16 tokens per image."""
    import transformers

    from shoal.engine.tools.tiny_model import make_llava_model

    transformers.logging.set_verbosity_error()
    return make_llava_model(tmp_path_factory.mktemp("model-llava"))


@pytest.fixture(scope="session")
def qwen_vl_model(tmp_path_factory):
    """A tiny Qwen2.5-VL (two-block windowed ViT, 2x2 merger, M-RoPE Qwen2 decoder) with its image processor: a
    56x56 image is 4 tokens, 84x112 (height x width) 12."""
    import transformers

    from shoal.engine.tools.tiny_model import make_qwen2_5_vl_model

    transformers.logging.set_verbosity_error()
    return make_qwen2_5_vl_model(tmp_path_factory.mktemp("model-qwen-vl"))


@pytest.fixture(scope="session")
def qwen2_vl_model(tmp_path_factory):
    """A tiny Qwen2-VL (two-block full-attention ViT, 2x2 merger, M-RoPE Qwen2 decoder); images as Qwen2.5-VL's."""
    import transformers

    from shoal.engine.tools.tiny_model import make_qwen2_5_vl_model

    transformers.logging.set_verbosity_error()
    return make_qwen2_5_vl_model(tmp_path_factory.mktemp("model-qwen2-vl"), qwen2=True)


@pytest.fixture(scope="session")
def qwen3_vl_model(tmp_path_factory):
    """A tiny Qwen3-VL (two-block ViT with deepstack mergers after both, 2x2 merger, interleaved M-RoPE over a Qwen3
    decoder) with its image processor (patch 16): a 64x64 image is 4 tokens, 96x128 (height x width) 12."""
    import transformers

    from shoal.engine.tools.tiny_model import make_qwen3_vl_model

    transformers.logging.set_verbosity_error()
    return make_qwen3_vl_model(tmp_path_factory.mktemp("model-qwen3-vl"))


@pytest.fixture(scope="session")
def qwen3_5_vl_model(tmp_path_factory):
    """A tiny Qwen3.5 vision-language model (Qwen3-VL's two-block ViT without deepstack over the hybrid Gated DeltaNet
    decoder, partial interleaved M-RoPE) with its image processor (patch 16): images as qwen3_vl_model's."""
    import transformers

    from shoal.engine.tools.tiny_model import make_qwen3_5_vl_model

    transformers.logging.set_verbosity_error()
    return make_qwen3_5_vl_model(tmp_path_factory.mktemp("model-qwen3_5-vl"))


@pytest.fixture(scope="session")
def qwen3_5_moe_vl_model(tmp_path_factory):
    """qwen3_5_vl_model with the MoE decoder (Qwen3_5MoeForConditionalGeneration: 4 experts top-2, a shared
    expert)."""
    import transformers

    from shoal.engine.tools.tiny_model import make_qwen3_5_vl_model

    transformers.logging.set_verbosity_error()
    return make_qwen3_5_vl_model(tmp_path_factory.mktemp("model-qwen3_5-moe-vl"), moe=True)



@pytest.fixture(scope="session")
def gemma3_vl_model(tmp_path_factory):
    """A tiny Gemma 3 vision-language model (two-layer SigLIP at 32 px, patch 4: 64 patches pooled to 16 tokens per
    image; a Gemma 3 decoder with window-8 sliding layers and one global layer) with its Gemma3Processor."""
    import transformers

    from shoal.engine.tools.tiny_model import make_gemma3_vl_model

    transformers.logging.set_verbosity_error()
    return make_gemma3_vl_model(tmp_path_factory.mktemp("model-gemma3-vl"))


@pytest.fixture(scope="module")
def collector():
    """An OTLP/HTTP trace collector (otlpkit) that the processes a tracing test starts export their spans to."""
    from otlpkit import Collector

    c = Collector()
    yield c
    c.close()
