"""TP=2, PP=2 and TP=2 x PP=2 (gloo, worker processes on this machine) against the single-process engine and
transformers: same greedy tokens, logprobs within float32 tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_reference import hf_greedy
from shoal.engine import LLM, SamplingParams
from shoal.engine.core.scheduler import ScheduledSeq, build_step_inputs
from shoal.engine.distributed.pipeline import split_micro_batches
from shoal.engine.distributed.wire import decode_call, encode_call
from shoal.engine.execution.sampling import SamplingRow

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello world! The quick brown",
    "Once upon a time there was a little shoal of fish that swam together in the warm",
    "def add(a, b):",
    "A",
    "Kubernetes runs pods on nodes; an operator reconciles custom resources",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100",
]
MAX_NEW = 10
# Small blocks and a small token budget: chunked prefill mixes with decodes, so micro-batches hold both.
OPTIONS = dict(block_size=4, max_model_len=128, num_kv_blocks=128, max_num_batched_tokens=24)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)

_single_cache: dict = {}


def single_process(model_dir):
    key = str(model_dir)
    if key not in _single_cache:
        with LLM(model=model_dir, **OPTIONS) as llm:
            _single_cache[key] = llm.generate(PROMPTS, PARAMS)
    return _single_cache[key]


def compare(model_dir, outputs, tokenizer):
    ref_outputs = single_process(model_dir)
    for prompt, out, ref in zip(PROMPTS, outputs, ref_outputs):
        got, single = out.outputs[0], ref.outputs[0]
        hf_ids, hf_lp = hf_greedy(model_dir, tokenizer.encode(prompt), MAX_NEW)
        assert got.token_ids == single.token_ids == hf_ids, prompt
        for step, (entry, single_entry) in enumerate(zip(got.logprobs, single.logprobs)):
            assert set(entry) == set(single_entry), (prompt, step)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(single_entry[tid].logprob, abs=1e-4), (prompt, step, tid)
                assert lp.logprob == pytest.approx(float(hf_lp[step, tid]), abs=2e-4), (prompt, step, tid)


LAYOUTS = [(2, 1), (1, 2), (2, 2)]


MICRO_BATCHES = 3  # the default is one per stage: three give uneven splits of 6 sequences


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("model", ["llama_kv1", "bloom4"])
def test_parallel_matches_single_process_and_transformers(request, model, tp, pp):
    model_dir = request.getfixturevalue(model)
    micro_batches = MICRO_BATCHES
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"micro_batches": micro_batches}, **OPTIONS) as llm:
        executor = llm.llm_engine.executor
        assert executor.group.world_size == tp * pp
        assert executor.shard.micro_batches == (micro_batches if pp > 1 else 1)
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
        if pp > 1:
            stats = executor.pipeline_stats()
            assert all(s["steps"] == stats[0]["steps"] > 0 for s in stats)
    # workers are gone and the process group is torn down: a single-process engine works again afterwards
    assert all(p.poll() is not None for _, p in executor.children)
    assert not torch.distributed.is_initialized()


# Gemma 2 (sliding window + soft-caps, tied head) splits heads and the vocabulary at tp=2; Gemma 3 (q/k norms,
# per-layer-type RoPE) splits layers 2 + 2 at pp=2; Phi-3 (fused qkv / gate_up tensors split at load, LongRoPE,
# all-windowed layers whose slid-out blocks are freed) both ways.
@pytest.mark.parametrize("arch,tp,pp", [("gemma2", 2, 1), ("gemma3", 1, 2), ("phi3", 2, 1), ("phi3", 1, 2)],
                         ids=lambda v: str(v))
def test_dense_2026_families_match_single_process(model_factory, arch, tp, pp):
    model_dir = model_factory(arch)
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **OPTIONS) as llm:
        compare(model_dir, llm.generate(PROMPTS, PARAMS), llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()


def test_tp2_kv_heads_split_qwen2(qwen2_gqa):
    """tp <= num_kv_heads: each rank owns its own KV head (QKV bias sliced too, tied LM head)."""
    with LLM(model=qwen2_gqa, tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.llm_engine.executor.runner.model.num_kv_heads_local == 1
        compare(qwen2_gqa, llm.generate(PROMPTS, PARAMS), llm.get_tokenizer())


# ------------------------------------------------------------------------------------------------ plan unit tests
class _Seq:
    def __init__(self, tokens, computed, blocks):
        self.token_ids, self.num_computed_tokens, self.block_ids = tokens, computed, blocks
        self.state_slot = None  # no recurrent state (a transformer's sequence)
        self.images = None  # a text-only prompt


def _Sched(seq, n, samples=True):
    return ScheduledSeq(seq, n, samples)  # no prompt logprobs, no speculative tokens in these plans


def _plan():
    scheduled = [_Sched(_Seq(list(range(10)), 0, [0, 1, 2]), 10), _Sched(_Seq(list(range(9)), 8, [3, 4, 5]), 1),
                 _Sched(_Seq(list(range(7)), 0, [6, 7]), 5, samples=False), _Sched(_Seq([5, 6, 7], 2, [8]), 1)]
    return build_step_inputs(scheduled, block_size=4)


def test_a_step_call_roundtrips():
    """What a worker receives for a step: the same plan (dtypes included; a micro-batch's views too) and rows."""
    inputs = _plan()
    rows = [SamplingRow(PARAMS, [1, 2], [3], uniform=0.25)]
    method, (back, back_rows, view) = decode_call(encode_call("execute_model", (inputs, rows, inputs.input_ids[2:5])))
    assert method == "execute_model" and torch.equal(view, inputs.input_ids[2:5])
    assert back_rows[0].params == PARAMS and back_rows[0].uniform == 0.25 and back_rows[0].output_token_ids == [3]
    for name, value in inputs.__dict__.items():
        other = getattr(back, name)
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(value, other), name
        else:
            assert value == other, name


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_micro_batches_cover_the_step_in_order(m):
    inputs = _plan()
    parts = split_micro_batches(inputs, m)
    assert len(parts) == min(m, 4)
    assert torch.equal(torch.cat([p.input_ids for p in parts]), inputs.input_ids)
    assert sum(p.logits_indices.numel() for p in parts) == inputs.logits_indices.numel()
    offset = 0
    for p in parts:
        assert int(p.query_start_loc[0]) == 0 and int(p.query_start_loc[-1]) == p.input_ids.numel()
        assert torch.equal(p.logits_indices + offset,
                           inputs.logits_indices[(inputs.logits_indices >= offset)
                                                 & (inputs.logits_indices < offset + p.input_ids.numel())])
        offset += p.input_ids.numel()


def test_micro_batches_carry_their_sequences_image_spans():
    # Gemma 3's bidirectional image spans (sequence, first position, end): each micro-batch gets those of its own
    # sequences, the sequence index re-based to the micro-batch and the positions kept
    inputs = dataclasses.replace(_plan(), image_spans=[(0, 2, 6), (2, 1, 4)])
    first, rest = split_micro_batches(inputs, 2)  # [sequence 0], [sequences 1..3]
    assert first.query_lens == [10] and first.image_spans == [(0, 2, 6)]
    assert rest.image_spans == [(1, 1, 4)]
    assert [p.image_spans for p in split_micro_batches(inputs, 4)] == [[(0, 2, 6)], None, [(0, 1, 4)], None]


def test_offline_engine_raises_instead_of_hanging_when_a_worker_dies(llama_kv1):
    import signal
    import time

    from shoal.engine.distributed.comm import DistributedError

    llm = LLM(model=llama_kv1, tensor_parallel_size=2, **OPTIONS)
    try:
        (rank, worker), = llm.llm_engine.executor.children
        worker.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(DistributedError):
            for _ in range(50):  # the first step may race the failure; one soon fails
                llm.generate(PROMPTS[:2], PARAMS)
                time.sleep(0.2)
        assert time.monotonic() - started < 15
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def test_failed_start_stops_the_workers_it_spawned(llama_kv1):
    """A configuration error found after the workers started (here: a KV pool too small for max_model_len)
    is reported and leaves no worker process or process group behind."""
    options = {**OPTIONS, "num_kv_blocks": 1}
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(model=llama_kv1, tensor_parallel_size=2, **options)
    assert not torch.distributed.is_initialized()
    assert not _live_worker_children(), "worker processes left behind"


def _live_worker_children() -> list[int]:
    """This test process's child `shoal.engine.distributed.worker` processes that are still running (not zombies)."""
    import os
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"shoal.engine.distributed.worker" in cmdline:
            pids.append(int(proc.name))
    return pids


def test_pipeline_samples_on_the_last_stage_like_one_process(llama_kv1):
    """Seeded random sampling with penalties and min_tokens gives the same tokens through a two-stage pipeline
    (where the last stage samples, with rank 0's seeded draws) as in one process."""
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=12, repetition_penalty=1.3, frequency_penalty=0.5,
                       max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, presence_penalty=1.0, min_tokens=4, max_tokens=8),
        SamplingParams(temperature=0.7, seed=13, n=2, max_tokens=8, ignore_eos=True),
    ]
    prompts = PROMPTS[:4]
    with LLM(model=llama_kv1, **OPTIONS) as llm:
        want = llm.generate(prompts, params)
    with LLM(model=llama_kv1, pipeline_parallel_size=2, **OPTIONS) as llm:
        got = llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], w.prompt
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]


def test_three_stage_pipeline_with_an_empty_middle_vocabulary(llama_kv1):
    """PP=3: the middle stage holds neither embedding nor LM head and the output is unchanged."""
    with LLM(model=llama_kv1, pipeline_parallel_size=3, **OPTIONS) as llm:
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(llama_kv1, outputs, llm.get_tokenizer())
