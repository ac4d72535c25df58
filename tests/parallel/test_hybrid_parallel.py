"""Hybrids over gloo (worker processes on this machine): tensor parallel (Qwen3-Next's and Qwen3.5's Gated DeltaNet
key heads, with the value heads each serves, split over the ranks; Granite 4's Mamba2 heads and their B/C groups;
attention heads split) and pipeline parallel (each stage keeps the recurrent state of its own layers) against the
single-process engine and transformers."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM
from test_tp_pp_equivalence import OPTIONS, PARAMS, PROMPTS, compare

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family,tp,pp", [("qwen3_next", 2, 1), ("qwen3_next", 1, 2), ("qwen3_5", 2, 1),
                                           ("qwen3_5", 1, 2), ("qwen3_5_moe", 2, 1)],
                         ids=["qwen3-next-tp2", "qwen3-next-pp2", "qwen3.5-tp2", "qwen3.5-pp2", "qwen3.5-moe-tp2"])
def test_gated_deltanet_hybrid_parallel_matches_single_process_and_transformers(model_factory, family, tp, pp):
    model_dir = model_factory(family)
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


@pytest.mark.parametrize("arch,tp,pp,groups", [
    ("granitemoehybrid", 2, 1, 2), ("granitemoehybrid", 2, 1, 1), ("granitemoehybrid", 1, 2, 2), ("nemotron_h", 2, 1, 2),
    ("nemotron_h", 1, 2, 2), ("falcon_h1", 2, 1, 2), ("falcon_h1", 1, 2, 2)],
    ids=["granite-tp2", "granite-tp2-one-group", "granite-pp2", "nemotron-h-tp2", "nemotron-h-pp2", "falcon-h1-tp2",
         "falcon-h1-pp2"])
def test_mamba2_hybrid_parallel_matches_single_process_and_transformers(model_factory, arch, tp, pp, groups):
    """Mamba2 heads split over the ranks: with 2 groups each rank holds one; with one group (Granite 4's releases)
    both hold it and the gated norm sums its squares over the ranks. Nemotron-H's MLP blocks hold no cache."""
    model_dir = model_factory(arch, **({"mamba_n_groups": groups} if arch == "granitemoehybrid" else {}))
    layers, heads = {"granitemoehybrid": (4, 8), "nemotron_h": (6, 8), "falcon_h1": (3, 6)}[arch]
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"collective_timeout": 120.0}, **OPTIONS) as llm:
        model = llm.llm_engine.executor.shard.runner.model
        mixer = next(layer.self_attn for layer in model.layers if hasattr(layer.self_attn, "allocate_state"))
        mamba = getattr(mixer, "mamba", mixer)  # Falcon-H1: attention and Mamba side by side
        assert (mamba.heads_local, mamba.groups_local) == (heads // tp, max(1, groups // tp))
        assert model.num_local_layers == -(-layers // pp)  # Falcon-H1's 3 layers: 2 on the first stage
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
        llm.llm_engine.state_pool.check_all_free()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["jamba-tp2", "jamba-pp2"])
def test_jamba_parallel_matches_single_process_and_transformers(model_factory, tp, pp):
    """Jamba's Mamba channels split over the ranks (x_proj row-parallel: every rank gets the whole time step, B and
    C), or its layers split into stages, each keeping its own layers' state."""
    model_dir = model_factory("jamba")
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"collective_timeout": 120.0}, **OPTIONS) as llm:
        model = llm.llm_engine.executor.shard.runner.model
        mamba = next(layer.self_attn for layer in model.layers if hasattr(layer.self_attn, "allocate_state"))
        assert mamba.inner_local == 128 // tp and model.num_local_layers == 4 // pp
        outputs = llm.generate(PROMPTS, PARAMS)
        compare(model_dir, outputs, llm.get_tokenizer())
        llm.llm_engine.pool.check_all_free()
        llm.llm_engine.state_pool.check_all_free()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_speculative_decoding_on_a_parallel_hybrid_rolls_every_rank_back(model_factory, tp, pp):
    """Rejected proposals restore the recurrent state on every rank (each holds its heads' or its layers' state):
    proposals right for 0..k of their tokens (hybridkit.OracleProposer), output equal to the single-process
    non-speculative engine's."""
    from hybridkit import OracleProposer

    model_dir = model_factory("qwen3_next")
    with LLM(model=model_dir, **OPTIONS) as llm:
        base = llm.generate(PROMPTS, PARAMS)
    continuations = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"collective_timeout": 120.0}, speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 3},
             **OPTIONS) as llm:
        engine = llm.llm_engine
        engine.proposer = OracleProposer(3, continuations, engine.vocab_size)
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in base]
        stats = engine.get_stats()
        assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
        engine.pool.check_all_free()
        engine.state_pool.check_all_free()
    assert not torch.distributed.is_initialized()
