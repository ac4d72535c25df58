"""Qwen3-Next over gloo (worker processes on this machine): tensor parallel (Gated DeltaNet key heads, with the
value heads each serves, split over the ranks; gated attention heads split) and pipeline parallel (each stage keeps
the recurrent state of its own layers) against the single-process engine and transformers."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM
from test_tp_pp_equivalence import OPTIONS, PARAMS, PROMPTS, compare

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_qwen3_next_parallel_matches_single_process_and_transformers(model_factory, tp, pp):
    model_dir = model_factory("qwen3_next")
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"collective_timeout": 120.0}, **OPTIONS) as llm:
        model = llm.llm_engine.executor.shard.runner.model  # rank 0's shard, in this process
        gdn = next(layer.self_attn for layer in model.layers if hasattr(layer.self_attn, "allocate_state"))
        assert (gdn.nk_local, gdn.nv_local) == (2 // tp, 4 // tp)
        assert model.num_local_layers == 4 // pp
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
        llm.llm_engine.state_pool.check_all_free()
    assert not torch.distributed.is_initialized()
