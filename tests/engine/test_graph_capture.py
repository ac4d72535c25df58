"""Decode graph capture (execution/graph_capture.py): buckets, padding, fallback, and equality with eager runs."""

from __future__ import annotations

import logging

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.graph_capture import batch_buckets

PROMPTS = [
    "Hello world! The quick brown",
    "Once upon a time there was a little shoal of fish",
    "def add(a, b):",
    "Kubernetes runs pods on nodes",
    "A",
    "numbers 0 1 2 3 4 5",
    "Ünïcödé text: naïve café",
]


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(256)[-1] == 256 and all(b % 8 == 0 for b in batch_buckets(256)[3:])


def generate(model_dir, prompts, **options):
    with LLM(model=model_dir, block_size=4, max_model_len=128, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, params)
        runner = llm.llm_engine.executor.runner
        graphs = runner.decode_graphs
        return outs, (graphs.num_padded_steps if graphs else 0), llm.llm_engine.pool


@pytest.mark.parametrize("n", [3, 5, 7])  # batches that pad up to buckets 4 and 8, shrinking as requests finish
def test_padded_bucket_gives_the_same_tokens_as_the_unpadded_batch(model_factory, n):
    model_dir = model_factory("llama")
    prompts = PROMPTS[:n]
    eager, none_padded, _ = generate(model_dir, prompts, decode_capture="none")
    padded, padded_steps, pool = generate(model_dir, prompts, decode_capture="eager")
    assert none_padded == 0 and padded_steps > 0
    for a, b in zip(eager, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid in ea:
                assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=1e-5)
    pool.check_all_free()


def test_enforce_eager_turns_capture_off(model_factory):
    with LLM(model=model_factory("llama"), max_model_len=128, decode_capture="eager", enforce_eager=True) as llm:
        assert llm.llm_engine.executor.runner.decode_graphs is None


def test_failed_capture_warns_and_runs_eagerly(model_factory, caplog):
    """cuda-graph capture cannot work without a GPU: the first decode step warns and every step runs eagerly."""
    model_dir = model_factory("llama")
    if torch.cuda.is_available():
        pytest.skip("this exercises the failure path, which needs a machine without CUDA")
    reference, _, _ = generate(model_dir, PROMPTS[:3], decode_capture="none")
    with caplog.at_level(logging.WARNING, logger="shoal.engine.execution.graph_capture"):
        outs, steps, _ = generate(model_dir, PROMPTS[:3], decode_capture="cuda-graph")
    assert steps == 0
    assert "decode graph capture failed" in caplog.text and "running decode steps eagerly" in caplog.text
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_same_tokens_as_eager(model_factory):
    model_dir = model_factory("llama")
    options = dict(device="cuda", attention_backend="triton", block_size=16, max_model_len=128)
    with LLM(model=model_dir, enforce_eager=True, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        eager = llm.generate(PROMPTS, params)
    with LLM(model=model_dir, **options) as llm:
        graphed = llm.generate(PROMPTS, params)
        graphs = llm.llm_engine.executor.runner.decode_graphs
        assert graphs is not None and graphs.graphs and graphs.num_padded_steps > 0
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


# ------------------------------------------------------------------------------------------ CPU decode graphs
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_cpu_graphs_give_the_eager_tokens_and_logprobs(model_factory, arch):
    """Outputs of different lengths, so the batch shrinks through buckets 8, 4, 2 and 1, each captured once and
    replayed; tokens equal the uncaptured run's and logprobs agree (padding rows change no real row's result
    beyond float32 summation order)."""
    from shoal.engine.execution import cpu_graph

    model_dir = model_factory(arch)
    params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    results = {}
    for capture in ("none", "cpu-graph"):
        with LLM(model=model_dir, block_size=4, max_model_len=128, decode_capture=capture) as llm:
            results[capture] = llm.generate(PROMPTS, params)
            graphs = llm.llm_engine.executor.runner.decode_graphs
            llm.llm_engine.pool.check_all_free()
    assert graphs.backend == "cpu-graph" and not graphs.failed
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert all(isinstance(g, cpu_graph.CpuGraph) for g, _ in graphs.graphs.values())
    for a, b in zip(results["none"], results["cpu-graph"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid in ea:
                assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=1e-5)


def test_cpu_graph_replays_exactly_and_refuses_host_reads():
    """A replay runs the recorded ops again on the same tensors (a weight updated in place is seen); a forward
    whose values reach the host (.item(), a tensor from Python data) cannot be captured."""
    from shoal.engine.execution import cpu_graph

    w = torch.randn(8, 8)
    x = torch.randn(2, 8)

    def forward():
        h = torch.nn.functional.linear(x, w).relu_()
        return torch.cat([h, h[:, :3] * 2.0], dim=1).softmax(-1)

    graph = cpu_graph.capture(forward)
    assert torch.equal(graph.replay(), forward())
    x.mul_(-1.5)  # new values in the same "static input buffer"
    w.add_(0.25)
    assert torch.equal(graph.replay(), forward())
    with pytest.raises(cpu_graph.CaptureError, match="aten::item returns float"):
        cpu_graph.capture(lambda: x * x.sum().item())
    with pytest.raises(cpu_graph.CaptureError, match="lift_fresh"):
        cpu_graph.capture(lambda: x + torch.tensor([1.0]))


# ------------------------------------------------------------------------------- the persistent CPU graph cache
def _cached_run(model_dir):
    """Greedy outputs of three prompts (buckets 4, 2, 1 as they finish) and how many graphs came from the cache."""
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    with LLM(model=model_dir, block_size=4, max_model_len=128, decode_capture="cpu-graph") as llm:
        outs = llm.generate(PROMPTS[:3], params)
        graphs = llm.llm_engine.executor.runner.decode_graphs
        assert not graphs.failed and sorted(graphs.graphs) == [1, 2, 4]
        return [o.outputs[0].token_ids for o in outs], graphs.num_loaded


@pytest.fixture
def graph_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    monkeypatch.setenv("SHOAL_GRAPH_CACHE", "1")  # tests/conftest.py turns it off for every other test
    return tmp_path / "cpu-graphs"


def _eager_tokens(model_dir):
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    with LLM(model=model_dir, block_size=4, max_model_len=128, enforce_eager=True) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]


def test_a_second_start_loads_its_cpu_graphs_from_the_cache(model_factory, graph_cache_dir, caplog):
    model_dir = model_factory("llama")
    first, loaded_first = _cached_run(model_dir)
    assert loaded_first == 0 and len(list(graph_cache_dir.glob("*.json"))) == 3
    with caplog.at_level(logging.INFO, logger="shoal.engine.execution.graph_capture"):
        second, loaded_second = _cached_run(model_dir)
    assert loaded_second == 3
    assert "loaded the CPU decode graph for batch size 1 from the cache" in caplog.text
    assert "captured the CPU decode graph" not in caplog.text
    assert first == second == _eager_tokens(model_dir)


def test_a_corrupt_cache_entry_is_recorded_afresh(model_factory, graph_cache_dir, caplog):
    model_dir = model_factory("llama")
    first, _ = _cached_run(model_dir)
    entries = sorted(graph_cache_dir.glob("*.json"))
    entries[0].write_text(entries[0].read_text()[:100])  # truncated
    entries[1].write_bytes(b"\xff\x00 not json")
    with caplog.at_level(logging.WARNING, logger="shoal.engine.execution.graph_capture"):
        second, loaded = _cached_run(model_dir)
    assert loaded == 1 and caplog.text.count("discarding the cached CPU decode graph") == 2
    assert first == second
    _, loaded_again = _cached_run(model_dir)  # the two were overwritten with good entries
    assert loaded_again == 3


def test_a_cache_entry_whose_constants_no_longer_fit_falls_back(model_factory, graph_cache_dir, caplog):
    import json

    model_dir = model_factory("llama")
    first, _ = _cached_run(model_dir)
    entries = sorted(graph_cache_dir.glob("*.json"))
    for path, tamper in zip(entries, ("shape", "name", "offset")):
        entry = json.loads(path.read_text())
        big = max(range(len(entry["constants"])), key=lambda i: sum(entry["constants"][i][2]))
        if tamper == "shape":  # a view past its base's storage
            entry["constants"][big][2] = [n * 1000 for n in entry["constants"][big][2]]
        elif tamper == "name":
            entry["constants"][big][0] = "model:no.such.weight"
        else:  # fits the storage but views other values: only the replay check can tell
            c = next(c for c in entry["constants"] if c[0].startswith("model:") and c[4] == 0 and len(c[2]) == 2)
            c[2][0] -= 1
            c[4] = c[3][0]
        path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="shoal.engine.execution.graph_capture"):
        second, loaded = _cached_run(model_dir)
    assert loaded == 0 and caplog.text.count("discarding the cached CPU decode graph") == 3
    assert first == second == _eager_tokens(model_dir)


def test_the_graph_cache_can_be_turned_off(model_factory, graph_cache_dir, monkeypatch):
    monkeypatch.setenv("SHOAL_GRAPH_CACHE", "0")
    model_dir = model_factory("llama")
    _cached_run(model_dir)
    _, loaded = _cached_run(model_dir)
    assert loaded == 0 and not graph_cache_dir.exists()


def test_a_constant_of_no_lasting_tensor_is_never_named():
    """A constant whose storage belongs to no tensor that outlives a step makes the graph uncacheable."""
    from shoal.engine.execution import graph_cache

    weight, stray = torch.randn(4, 4), torch.randn(4)
    bases = {weight.untyped_storage().data_ptr(): ("model:w", weight)}
    assert graph_cache.describe_constants([weight[1:, :2]], bases) == [["model:w", "torch.float32", [3, 2], [4, 1], 4]]
    assert graph_cache.describe_constants([weight.t(), stray], bases) is None
    view, = graph_cache.rebuild_constants([["model:w", "torch.float32", [3, 2], [4, 1], 4]], bases)
    assert torch.equal(view, weight[1:, :2]) and view.data_ptr() == weight[1:, :2].data_ptr()
    with pytest.raises(graph_cache.EntryError, match="past its 64 bytes"):
        graph_cache.rebuild_constants([["model:w", "torch.float32", [4, 4], [4, 1], 1]], bases)
