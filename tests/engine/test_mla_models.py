"""DeepSeek V3 and V2 and GLM-4.7-Flash (multi-head latent attention, grouped MoE routing) against transformers in every engine mode:
same greedy tokens, logprobs within float32 tolerance. Tiny random-weight models (tools/tiny_model.py: 3 layers, the
first dense, 8 experts in 4 groups with 2 kept, top-2, a shared expert; V3 with q_lora_rank and a nonzero routing
correction bias, V2-Lite-style without q_lora_rank; YaRN with mscale_all_dim). Also: the latent cache's layout and
capacity, the fp8 latent cache, and configs refused at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers.mla import LatentAttention, LatentKVCache
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.tools.tiny_model import MLA_ARCHS
from test_engine_correctness import (check_against_hf, check_mode_against_hf, family_engine, family_fixture,
                                     prefix_sharing_runs)
from test_kv_fp8 import assert_fp8_greedy_close

pytestmark = pytest.mark.numerics

ARCHITECTURE = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
SPARSE_LAYERS = {"glm4_moe_lite": [True, False, True]}  # mlp_layer_types; DeepSeek: all after the first
MODES = {
    "batched": dict(block_size=4, max_model_len=128),
    # A pool too small for the batch and an 8-token budget: chunked prompts, decodes mixed in, preemptions.
    "chunked-preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=8),
    # The portable path: SDPA over the gathered latent blocks.
    "sdpa-chunked": dict(block_size=4, max_model_len=128, max_num_batched_tokens=8, attention_backend="sdpa"),
    # Decode steps padded to batch-size buckets from static buffers.
    "decode-capture": dict(block_size=4, max_model_len=128, decode_capture="eager"),
}
# kv_lora_rank 32 + qk_rope_head_dim 8 per token and layer, against 4 heads x (24 key + 12 value) for full K/V.
LATENT, FULL_KV = 40, 4 * (24 + 12)


family = family_fixture(MLA_ARCHS)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(family, mode):
    arch, model_dir = family
    with family_engine(model_dir, ARCHITECTURE[arch], **MODES[mode]) as llm:
        engine = llm.llm_engine
        model = engine.executor.runner.model
        assert engine.executor.backend_name == MODES[mode].get("attention_backend", "cpu")
        assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.layers)
        sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
        assert sparse == SPARSE_LAYERS.get(arch, [False, True, True])
        check_mode_against_hf(llm, model_dir, mode)


def test_prefix_caching_serves_repeated_prompts_from_the_latent_cache(model_factory):
    model_dir = model_factory("deepseek_v3")
    with LLM(model=model_dir, block_size=4, max_model_len=128) as llm:
        prompts, params, first, rest = prefix_sharing_runs(llm)
        again = llm.generate(prompts[:1], params)
        assert all(o.num_cached_tokens >= 4 for o in rest + again)
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        check_against_hf(model_dir, llm.get_tokenizer(), first + rest + again, prompts + prompts[:1])


def test_latent_cache_holds_one_entry_per_token_and_more_tokens_per_byte(model_factory):
    model_dir = model_factory("deepseek_v3")
    memory = 1 << 20
    with LLM(model=model_dir, block_size=4, max_model_len=128, kv_cache_memory=memory) as llm:
        runner = llm.llm_engine.executor.runner
        caches = runner.kv_caches
        assert len(caches) == 3 and all(isinstance(c, LatentKVCache) for c in caches)
        assert all(c.k is c.v and c.k.shape[1:] == (4, 1, LATENT) and c.k.dtype == torch.float32 for c in caches)
        assert runner.bytes_per_block(4) == 3 * LATENT * 4 * 4  # layers x latent x float32 x block
        assert runner.kv_cache_bytes <= memory
        blocks = llm.llm_engine.pool.num_blocks
        # The same budget as full K/V of this model (one key of 24 and one value of 12 per head) would hold 3.6x less.
        assert blocks + runner.padding_blocks == memory // (3 * LATENT * 4 * 4)
        assert blocks / (memory // (3 * FULL_KV * 4 * 4)) == pytest.approx(FULL_KV / LATENT, rel=0.01)


def test_fp8_latent_cache(model_factory):
    """--kv-cache-dtype fp8: the latent stored as e4m3 with one float32 scale per token, ~1.8x the tokens of bf16 in
    the same memory, greedy generation close to the bf16 cache."""
    model_dir = model_factory("deepseek_v3")
    # (Not a one-token prompt: its first token attends to one latent, whose fp8 rounding alone moves this flat
    # random model's top logprobs by ~0.3 nats, enough to swap its two best tokens.)
    prompts = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish",
               "Kubernetes runs pods on nodes"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    memory = 1 << 20
    results = {}
    for kv in ("auto", "fp8"):
        with LLM(model=model_dir, dtype="bfloat16", block_size=4, max_model_len=128, kv_cache_memory=memory,
                 kv_cache_dtype=kv) as llm:
            engine = llm.llm_engine
            caches = engine.executor.runner.kv_caches
            assert all(c.is_fp8 == (kv == "fp8") and c.k is c.v for c in caches)
            if kv == "fp8":
                assert caches[0].k.dtype == torch.float8_e4m3fn and caches[0].k_scale.shape == (
                    caches[0].k.shape[0], 4, 1)
            results[kv] = (engine.pool.num_blocks, llm.generate(prompts, params, use_tqdm=False))
            engine.pool.check_all_free()
    (blocks_auto, out_auto), (blocks_fp8, out_fp8) = results["auto"], results["fp8"]
    assert blocks_fp8 / blocks_auto == pytest.approx(2 * LATENT / (LATENT + 4), rel=0.01)  # bf16 vs e4m3 + scale
    diffs = assert_fp8_greedy_close(out_auto, out_fp8)
    print("fp8 vs bf16 latent cache, |logprob difference| of the greedy tokens:", diffs)


@pytest.mark.parametrize("arch,field,value,message", [
    ("deepseek_v3", "kv_lora_rank", 0, "config field kv_lora_rank must be a positive integer"),
    ("deepseek_v3", "qk_rope_head_dim", 7, "config field qk_rope_head_dim must be even"),
    ("deepseek_v3", "n_group", 3, r"config field n_group \(3\) must divide n_routed_experts \(8\)"),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types must give 'dense' or 'sparse'"),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "sparse"], "for each of the 3 layers"),
])
def test_inconsistent_config_is_refused_at_load_naming_the_field(model_factory, tmp_path, arch, field, value,
                                                                 message):
    model_dir = tmp_path / "bad"
    shutil.copytree(model_factory(arch), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config[field] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, block_size=4, max_model_len=64)
