"""Bad model directories fail at load with a message that names the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightError


@pytest.fixture
def model_copy(llama_model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(llama_model, dst)
    return dst


@pytest.fixture
def sharded_copy(model_factory, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(model_factory("llama", max_shard_size="40KB"), dst)
    return dst


def load(path, **kw):
    return LLM(model=str(path), max_model_len=64, **kw)


def test_missing_directory(tmp_path):
    with pytest.raises(WeightError, match="no such model directory"):
        load(tmp_path / "nope")


def test_hub_id_not_in_local_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightError, match="not in the local Hugging Face cache"):
        load("some-org/some-model")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(WeightError, match="config.json is missing"):
        load(model_copy)


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture \['FancyNewForCausalLM'\].*LlamaForCausalLM") as err:
        load(model_copy)
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert arch in str(err.value)


def test_no_safetensors(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(WeightError, match="no \\*.safetensors files"):
        load(model_copy)


def test_missing_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightError, match=f"{shard.name}: shard listed in model.safetensors.index.json is missing"):
        load(sharded_copy)


def test_corrupt_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated: header intact, data cut off
    with pytest.raises(WeightError, match=shard.name):
        load(sharded_copy)


def test_garbage_header(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightError, match="model.safetensors"):
        load(model_copy)


def test_shape_mismatch_names_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape"):
        load(model_copy)


def test_missing_tensor_names_it(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_copy / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match="'model.layers.1.self_attn.o_proj.weight' is missing"):
        load(model_copy)


def test_missing_tokenizer(model_copy):
    for f in model_copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        load(model_copy)


def test_kv_cache_too_small_for_max_model_len(llama_model):
    with pytest.raises(ValueError, match="fewer than max_model_len=64"):
        load(llama_model, num_kv_blocks=2, block_size=4)


def test_prompt_longer_than_context_is_rejected_not_queued(llama_model):
    with load(llama_model) as llm:
        with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
            llm.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([{"prompt_token_ids": [5, 10**6]}])
        with pytest.raises(ValueError, match="empty"):
            llm.generate([{"prompt_token_ids": []}])
        assert not llm.llm_engine.has_unfinished_requests()
        llm.llm_engine.pool.check_all_free()
