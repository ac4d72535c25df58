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
]


@pytest.mark.parametrize("arch,tp,pp,ep", CASES, ids=lambda v: str(v))
def test_moe_parallel_matches_single_process_and_transformers(model_factory, arch, tp, pp, ep):
    model_dir = model_factory("olmoe", num_key_value_heads=1) if arch == "olmoe-kv1" else model_factory(arch)
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
             **OPTIONS) as llm:
        executor = llm.llm_engine.executor
        model = executor.shard.runner.model  # rank 0's shard, in this process
        block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
        experts = block.experts
        if ep:
            assert (experts.num_local, experts.expert_start, experts.inter_local) == (2, 0, experts.intermediate)
        else:
            assert (experts.num_local, experts.inter_local) == (4, experts.intermediate // tp)
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
    assert not torch.distributed.is_initialized()
