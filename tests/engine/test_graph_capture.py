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
