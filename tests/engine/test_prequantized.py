"""GPTQ (4/8-bit, groups, act-order g_idx) and AWQ (4-bit GEMM) checkpoints packed from round-to-nearest weights;
the oracle is transformers running the same dequantized weights densely: greedy tokens equal, logprobs within
float32 tolerance."""

from __future__ import annotations

import json

import pytest
import torch

from hf_reference import assert_greedy_matches
from prequant_fixtures import write_compressed_tensors_int8, write_prequantized
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightError

pytestmark = pytest.mark.numerics

PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish", "def add(a, b):"]
MAX_NEW = 8
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4)

CASES = {
    "gptq-4bit-g32": dict(method="gptq", bits=4, group=32),
    "gptq-8bit-g32": dict(method="gptq", bits=8, group=32),
    "gptq-4bit-act-order": dict(method="gptq", bits=4, group=32, act_order=True),
    "gptq-4bit-one-group": dict(method="gptq", bits=4, group=96),
    "awq-4bit-g32": dict(method="awq", group=32),
}


def _assert_greedy_matches_oracle(model_dir, oracle, caplog) -> None:
    """Greedy tokens equal transformers on the dense oracle, logprobs within float32 tolerance."""
    caplog.set_level("INFO", logger="shoal.engine.execution.quantization.prequantized")
    with LLM(model=str(model_dir), **OPTIONS) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=3))
        tok = llm.get_tokenizer()
    assert_greedy_matches(oracle, tok, PROMPTS, outputs, MAX_NEW)


@pytest.mark.parametrize("case", list(CASES))
def test_prequantized_checkpoint_matches_transformers_on_dequantized_weights(model_factory, tmp_path, case, caplog):
    out, oracle = tmp_path / "quantized", tmp_path / "oracle"
    write_prequantized(model_factory("llama"), out, oracle, **CASES[case])
    _assert_greedy_matches_oracle(out, oracle, caplog)
    assert "dequantized on load" in caplog.text and "21 packed linear layers" in caplog.text


def test_prequantized_then_int4_kernel(model_factory, tmp_path):
    out, oracle = tmp_path / "quantized", tmp_path / "oracle"
    write_prequantized(model_factory("llama"), out, oracle, method="awq", group=32)
    with LLM(model=str(out), quantization="int4", **OPTIONS) as llm:
        text = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(text[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_int8_matches_transformers_on_dequantized_weights(model_factory, tmp_path, strategy,
                                                                             caplog):
    out, oracle = tmp_path / "quantized", tmp_path / "oracle"
    write_compressed_tensors_int8(model_factory("llama"), out, oracle, strategy)
    _assert_greedy_matches_oracle(out, oracle, caplog)
    assert "COMPRESSED-TENSORS 8-bit" in caplog.text and "21 packed linear layers" in caplog.text


def test_compressed_tensors_int8_then_int8_kernel_keeps_the_checkpoint_integers(model_factory, tmp_path):
    """--quantization int8 over a per-channel int8 checkpoint re-quantizes every row to the checkpoint's own
    integers and scales (up to one float32 rounding of the scale) where the CPU has VNNI; without it, to the
    nearest 7-bit integers of the checkpoint's weights."""
    from safetensors.torch import load_file

    from shoal.engine.execution.layers.linear import PackedMatmul
    from shoal.engine.execution.quantization.int8 import Int8Weight

    out, oracle = tmp_path / "quantized", tmp_path / "oracle"
    write_compressed_tensors_int8(model_factory("llama"), out, oracle)
    dense = load_file(str(oracle / "model.safetensors"))
    with LLM(model=str(out), quantization="int8", **OPTIONS) as llm:
        net = llm.llm_engine.executor.runner.model
        o_proj = next(m for n, m in net.named_modules() if n.endswith("layers.0.self_attn.o_proj"))
        assert isinstance(o_proj, PackedMatmul) and isinstance(o_proj.format, Int8Weight)
        deq = o_proj.format.dequantize()
        text = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ref = dense["model.layers.0.self_attn.o_proj.weight"]
    if o_proj.format.weight_limit(torch.device("cpu")) == 127:
        assert torch.allclose(deq, ref, rtol=1e-6, atol=0)
    else:  # no VNNI: 7-bit weights (quantization/int8.py), so the checkpoint's integers are rounded once more
        step = ref.abs().amax(dim=1, keepdim=True) / 63
        assert "7-bit" in o_proj.format.kernel
        assert ((deq - ref).abs() <= step / 2 * (1 + 1e-5)).all()
    assert len(text[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {}}},
     "compressed-tensors format 'float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "only symmetric int8 per channel or per tensor"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ with 3 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ gemv"),
])
def test_unsupported_quantization_configs_are_refused_clearly(model_factory, tmp_path, qc, match):
    out, oracle = tmp_path / "quantized", tmp_path / "oracle"
    write_prequantized(model_factory("llama"), out, oracle, method="gptq", bits=4, group=32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=match):
        LLM(model=str(out), **OPTIONS)
