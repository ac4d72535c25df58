"""Quantized models under tensor parallelism (gloo, two worker processes): a GGUF file at tp=2 equals the single
process; --quantization int8 at tp=2 stays within the single-process quantization error of the dense model."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from shoal.engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # gguf_fixtures
from gguf_fixtures import write_gguf  # noqa: E402

pytestmark = pytest.mark.slow
importlib.import_module("gguf")

PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish", "def add(a, b):"]
OPTIONS = dict(dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=128)
# These tests check results, not failure detection: a rank slowed by a loaded machine must not time out.
PARALLEL = dict(tensor_parallel_size=2, distributed={"collective_timeout": 120.0})
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)


def _run(model_path, **kw):
    with LLM(model=str(model_path), **OPTIONS, **kw) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("weight_type,packed", [("Q8_0", True), ("Q4_K", False)])
def test_gguf_at_tp2_equals_one_process(model, tmp_path, monkeypatch, weight_type, packed):
    """Packed blocks split between ranks at block boundaries (Q8_0's 32 columns divide this model's halves); a
    Q4_K block (256 columns) would be cut in two here, which the packed loader refuses by name
    (test_gguf_packed.py), so that file runs dequantized on load, as SHOAL_GGUF_DEQUANTIZE=1 asks."""
    if not packed:
        monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1")  # inherited by the worker ranks
    path = write_gguf(model, tmp_path / f"tiny-{weight_type.lower()}.gguf", weight_type=weight_type,
                      embed_type="Q8_0")
    ref, got = _run(path), _run(path, **PARALLEL)
    # The packed kernels round activations to 16-bit groups: the row-parallel layers' other summation order moves
    # a rounding now and then, which later layers carry (measured up to 2.2e-4 nats; dequantized: float noise).
    tolerance = 1e-3 if packed else 2e-4
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        for ea, eb in zip(a.logprobs, b.logprobs):
            for t in ea:
                assert eb[t].logprob == pytest.approx(ea[t].logprob, abs=tolerance)


def test_int8_at_tp2_stays_close_to_the_dense_model(model):
    dense, got = _run(model), _run(model, quantization="int8", **PARALLEL)
    diffs = [abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob)
             for a, b in zip(dense, got) for t in set(a.logprobs[0]) & set(b.logprobs[0])]
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 1.0, diffs


def test_fp8_kv_cache_at_tp2_equals_one_process(model):
    """Scales are per (slot, kv head) and each rank owns whole kv heads: tp=2 quantizes exactly what one process
    does, so the results agree to float32 rounding (and the workers got --kv-cache-dtype: an auto cache differs)."""
    ref, got = _run(model, kv_cache_dtype="fp8"), _run(model, kv_cache_dtype="fp8", **PARALLEL)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        for ea, eb in zip(a.logprobs, b.logprobs):
            for t in ea:
                assert eb[t].logprob == pytest.approx(ea[t].logprob, abs=2e-4)
    dense = _run(model)
    assert any(abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob) > 1e-3
               for a, b in zip(dense, got) for t in set(a.logprobs[0]) & set(b.logprobs[0]))
