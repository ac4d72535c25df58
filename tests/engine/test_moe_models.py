"""Qwen3 and the mixture-of-experts families against transformers, in every engine mode: same greedy tokens, logprobs
within float32 tolerance. Tiny random-weight models (3 layers, GQA, 4 experts with top-2; see tools/tiny_model.py)."""

from __future__ import annotations


import pytest

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.tools.tiny_model import MOE_ARCHS
from test_engine_correctness import (PROMPTS, check_against_hf, check_mode_against_hf, family_engine, family_fixture,
                                     prefix_sharing_runs)

FAMILIES = ["qwen3", *MOE_ARCHS]
ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}

MODES = {
    "default": dict(block_size=4, max_model_len=128),
    # A pool too small for the batch and an 8-token budget: chunked prompts, decodes mixed in, preemptions.
    "chunked-preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=8),
    # Decode steps padded to batch-size buckets from static buffers: padding rows are routed like real ones.
    "decode-capture": dict(block_size=4, max_model_len=128, decode_capture="eager"),
}


family = family_fixture(FAMILIES)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(family, mode):
    arch, model_dir = family
    with family_engine(model_dir, ARCHITECTURE[arch], **MODES[mode]) as llm:
        model = llm.llm_engine.executor.runner.model
        sparse = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        # qwen2_moe: layer 1 is in mlp_only_layers; qwen3_moe: layer 2 is; qwen3: dense everywhere.
        assert sparse == {"qwen3": [], "qwen2_moe": [0, 2], "qwen3_moe": [0, 1]}.get(arch, [0, 1, 2])
        check_mode_against_hf(llm, model_dir, mode)


def test_prefix_caching_reuses_blocks_and_matches(family):
    arch, model_dir = family
    with LLM(model=model_dir, block_size=4, max_model_len=128) as llm:
        prompts, _, first, rest = prefix_sharing_runs(llm)
        assert all(o.num_cached_tokens >= 4 for o in rest)
        check_against_hf(model_dir, llm.get_tokenizer(), first + rest, prompts)


def test_sharded_checkpoint_streams_each_expert_once(model_factory, monkeypatch):
    """Several safetensors shards with an index: every tensor of the checkpoint is read, each exactly once."""
    from shoal.engine.execution.weights import WeightSource

    model_dir = model_factory("mixtral", max_shard_size="60KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    reads: list[str] = []
    load = WeightSource.load
    monkeypatch.setattr(WeightSource, "load", lambda self, name, *a, **kw: reads.append(name) or load(self, name, *a, **kw))
    with LLM(model=model_dir, block_size=4, max_model_len=64) as llm:
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        check_against_hf(model_dir, llm.get_tokenizer(), out, PROMPTS[:2], max_new=4)
    assert len(reads) == len(set(reads)) == len(WeightSource(model_dir).names())


def test_unsupported_architecture_lists_the_families(tmp_path):
    from shoal.engine.execution.models import model_class

    class Config:
        architectures = ["XLNetLMHeadModel"]

    with pytest.raises(ValueError, match=r"unsupported architecture \['XLNetLMHeadModel'\]") as e:
        model_class(Config())
    for name in ARCHITECTURE.values():
        assert name in str(e.value)
