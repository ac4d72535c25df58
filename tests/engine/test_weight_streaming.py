"""Fast start: tensors are views of the memory-mapped shards (no copy before the parameter's), layers load on
several threads, and neither changes a single weight or a greedy token; the start-up breakdown is measured."""

from __future__ import annotations

import torch
from safetensors import safe_open

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightSource, parallel_map

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 14, 3, 7]}, {"prompt_token_ids": [2, 8, 8, 11]}]


def _llm(path, monkeypatch, threads: int) -> LLM:
    monkeypatch.setenv("SHOAL_LOAD_THREADS", str(threads))
    return LLM(model=str(path), max_model_len=64, dtype="float32")


def test_parallel_loading_gives_the_serial_weights_and_tokens(model_factory, monkeypatch):
    # bfloat16 shards of ~40 KB: several files, a dtype conversion on the way into float32 parameters
    path = model_factory("llama", dtype="bfloat16", max_shard_size="40KB")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with _llm(path, monkeypatch, 1) as serial:
        serial_weights = {k: v.clone() for k, v in serial.llm_engine.executor.runner.model.state_dict().items()}
        serial_out = [o.outputs[0].token_ids for o in serial.generate(PROMPTS, params)]
    with _llm(path, monkeypatch, 4) as parallel:
        weights = parallel.llm_engine.executor.runner.model.state_dict()
        assert weights.keys() == serial_weights.keys()
        for name, value in weights.items():
            assert torch.equal(value, serial_weights[name]), f"{name} differs between parallel and serial loading"
        assert [o.outputs[0].token_ids for o in parallel.generate(PROMPTS, params)] == serial_out


def test_views_equal_what_safetensors_reads(model_factory):
    path = model_factory("llama", dtype="bfloat16", max_shard_size="40KB")
    src = WeightSource(path, threads=4)
    checked = 0
    for name in sorted(src.names()):
        file = src._file_of[name]
        with safe_open(str(file), framework="pt") as f:
            reference = f.get_slice(name)
            full = reference[:]
            assert torch.equal(src.load(name), full), name
            if full.dim() == 2 and full.shape[1] >= 4:  # a tensor-parallel rank's columns
                cols = src.load(name, dim=1, start=1, length=2)
                assert cols.is_contiguous() and torch.equal(cols, full[:, 1:3])
                assert torch.equal(src.load(name, dim=0, start=1, length=2), full[1:3])
                checked += 1
    assert checked > 0


def test_an_in_place_change_never_reaches_the_file(model_factory, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(model_factory("llama"), path)
    src = WeightSource(path)
    name = sorted(src.names())[0]
    before = (src._file_of[name]).read_bytes()
    src.load(name).mul_(0)  # a model that scales a weight in place after loading it
    src.close()
    assert src._file_of[name].read_bytes() == before


def test_parallel_map_raises_the_first_failure_after_all_stopped():
    done = []

    def work(i):
        if i == 2:
            raise ValueError("layer 2")
        done.append(i)

    try:
        parallel_map(work, range(6), threads=3)
    except ValueError as e:
        assert str(e) == "layer 2"
    else:
        raise AssertionError("the failure was swallowed")
    assert sorted(done) == [0, 1, 3, 4, 5]
