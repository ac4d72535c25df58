"""MoE families over gloo (worker processes on this machine): tensor parallel (every expert's width split),
expert parallel (whole experts per rank) and pipeline parallel against the single-process engine and transformers."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM
from shoal.engine.execution.layers.moe import SparseMoeBlock
from test_tp_pp_equivalence import OPTIONS, PARAMS, PROMPTS, compare

pytestmark = pytest.mark.slow

# Few runs (each starts worker processes on a 2-core machine), each covering a different path:
CASES = [
    ("mixtral", 2, 1, False),    # every expert's intermediate width split 2 ways, one all-reduce per block
    ("olmoe", 2, 1, False),      # q/k norm over the whole projection, its mean of squares summed over the ranks
    ("olmoe-kv1", 2, 1, False),  # ... with the one key head replicated on both ranks (counted once)
    ("qwen2_moe", 2, 1, True),   # expert parallel: 2 of 4 experts per rank, plus the TP-split shared expert
    ("qwen3_moe", 1, 2, False),  # pipeline stages with sparse and dense layers
    ("gpt_oss", 2, 1, False),    # sinks split by head, expert biases: down's added on one rank only
    ("gpt_oss", 2, 1, True),     # ... whole experts per rank, each adding its own down bias
    # The all-to-all token exchange instead of the all-reduce (distributed/expert_exchange.py), forced:
    ("qwen2_moe-a2a", 2, 1, True),  # ... plus the shared expert, still summed by an all-reduce
    ("gpt_oss-a2a", 2, 1, True),
]


@pytest.mark.parametrize("arch,tp,pp,ep", CASES, ids=lambda v: str(v))
def test_moe_parallel_matches_single_process_and_transformers(model_factory, arch, tp, pp, ep, monkeypatch, caplog):
    from shoal.engine.distributed import expert_exchange

    arch, a2a = arch.removesuffix("-a2a"), arch.endswith("-a2a")
    model_dir = model_factory("olmoe", num_key_value_heads=1) if arch == "olmoe-kv1" else model_factory(arch)
    if ep:  # the workers inherit the environment; rank 0 runs in this process
        monkeypatch.setenv("SHOAL_EP_EXCHANGE", "all_to_all" if a2a else "auto")
    exchanged = []
    run = expert_exchange.all_to_all_experts
    monkeypatch.setattr(expert_exchange, "all_to_all_experts", lambda *a: exchanged.append(1) or run(*a))
    caplog.set_level("INFO", logger="shoal.engine.distributed.expert_exchange")
    # A generous collective timeout: on a loaded 2-core machine one rank can fall 20 s (the default) behind.
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
             distributed={"collective_timeout": 120.0}, **OPTIONS) as llm:
        executor = llm.llm_engine.executor
        model = executor.shard.runner.model  # rank 0's shard, in this process
        block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
        experts = block.experts
        if ep:
            assert (experts.num_local, experts.expert_start, experts.inter_local) == (2, 0, experts.intermediate)
            if not a2a:  # measured at start: both exchanges timed on this group, the choice logged
                assert "measured on this group" in caplog.text and "16 tokens: all-reduce" in caplog.text
                assert set(block.ps.expert_exchange.measured) == {16, 256}
        else:
            assert (experts.num_local, experts.inter_local) == (4, experts.intermediate // tp)
        exchanged.clear()  # the start-up measurement ran it too
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
        if a2a:
            assert exchanged, "the all-to-all exchange was meant to run"
        elif not ep or block.ps.expert_exchange.all_to_all_from is None:
            assert not exchanged
    assert not torch.distributed.is_initialized()
