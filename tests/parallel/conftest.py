"""Multi-process tests: tiny models with tensor-parallel-friendly head counts, one thread per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Every rank is a process on this (2-core) machine: one intra-op thread each, inherited by the workers.
os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # hf_reference


@pytest.fixture(scope="session")
def llama_kv1(model_factory):
    """Llama with 4 query heads and ONE key/value head: at tp=2 the KV head is replicated on both ranks."""
    return model_factory("llama", num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4)


@pytest.fixture(scope="session")
def qwen2_gqa(model_factory):
    """Qwen2 (QKV bias, tied head) with 6 query / 2 KV heads: at tp=2 each rank owns one KV head."""
    return model_factory("qwen2", num_hidden_layers=3)


@pytest.fixture(scope="session")
def bloom4(model_factory):
    """BLOOM with 4 heads (ALiBi slopes split 2 + 2 at tp=2)."""
    return model_factory("bloom", n_head=4, n_layer=4)
