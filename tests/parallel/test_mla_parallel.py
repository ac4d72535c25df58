"""DeepSeek V3 and V2 and GLM-4.7-Flash (MLA; V2 without the q low-rank projection, group-limited greedy routing)
over gloo (worker processes on this machine): tensor parallel (query heads, kv_b_proj and o_proj split by head, the
latent projected and cached whole on every rank, every expert's width split) and pipeline parallel (layers 2 + 1),
against the single-process engine and transformers."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM
from shoal.engine.execution.layers.mla import LatentAttention
from test_tp_pp_equivalence import OPTIONS, PARAMS, PROMPTS, compare, single_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch,tp,pp", [("deepseek_v3", 2, 1), ("deepseek_v2", 2, 1), ("deepseek_v3", 1, 2),
                                      ("glm4_moe_lite", 1, 2)],
                         ids=lambda v: str(v))
def test_mla_parallel_matches_single_process_and_transformers(model_factory, arch, tp, pp):
    model_dir = model_factory(arch)
    # The single-process run first: made while the group is up, it could outlast an idle stage's receive timeout.
    single_process(model_dir)
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"collective_timeout": 120.0}, **OPTIONS) as llm:
        runner = llm.llm_engine.executor.shard.runner  # rank 0's shard, in this process
        attn = runner.model.layers[0].self_attn
        assert isinstance(attn, LatentAttention) and attn.num_heads == 4 // tp
        assert len(runner.kv_caches) == (3 if pp == 1 else 2)  # 3 layers: 2 on the first stage
        assert runner.kv_caches[0].k.shape[2:] == (1, 32 + 8)  # the whole latent on every rank
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
    assert not torch.distributed.is_initialized()
