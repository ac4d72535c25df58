"""Hybrid models (recurrent layers next to paged attention; the Gated DeltaNet families: Qwen3-Next, Qwen3.5 dense as
a vision-language checkpoint and Qwen3.5 MoE): transformers' greedy tokens and logits under every scheduling regime,
with the C++ delta-rule kernels and with the torch forms; the kernels against the recurrence; the recurrent-state
slots (one budget with the KV blocks, freed on finish, abort and preemption), and checkpoints
refused at load."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.gated_delta_net import RecurrentState, chunk_delta_rule, recurrent_step
from test_engine_correctness import PROMPTS, check_against_hf

pytestmark = pytest.mark.numerics

MAX_NEW = 12
REGIMES = {
    "batched": dict(block_size=4, max_model_len=128),
    # 8-token chunks: prompts cross several steps, each carrying the conv and recurrent state to the next.
    "chunked-prefill": dict(block_size=4, max_model_len=128, max_num_batched_tokens=8),
    # 5-token chunks over 2-token blocks: chunk boundaries fall at every offset of the conv kernel's window (4).
    "odd-chunks": dict(block_size=2, max_model_len=128, max_num_batched_tokens=5),
    "preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=16),
    "sdpa": dict(block_size=8, max_model_len=128, attention_backend="sdpa"),
}


@pytest.fixture(scope="module")
def qwen3_next(model_factory):
    return model_factory("qwen3_next")


GDN_FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_gated_deltanet_hybrid_greedy_matches_transformers(model_factory, family, regime):
    model = model_factory(family)
    with LLM(model=model, **REGIMES[regime]) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate(PROMPTS, params)
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS, max_new=MAX_NEW)
        engine = llm.llm_engine
        assert engine.executor.runner.decode_graphs is None  # recurrent state: decode steps run eagerly
        if regime == "preemption":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
        engine.pool.check_all_free()
        engine.state_pool.check_all_free()


@pytest.mark.parametrize("regime", ["odd-chunks", "preemption"])
def test_torch_delta_rule_fallback_matches_transformers(model_factory, monkeypatch, regime):
    """Without the C++ kernels (no compiler, or off CPU): the chunked delta rule for prompts, the gathered
    recurrence for decode."""
    monkeypatch.setattr(ssm_scan, "load_kernels", lambda: None)
    model = model_factory("qwen3_next")
    with LLM(model=model, **REGIMES[regime]) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=5))
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS, max_new=MAX_NEW)
        llm.llm_engine.state_pool.check_all_free()


def test_delta_rule_chunk_kernel_equals_the_recurrence():
    """The C++ chunk scan (2 key heads feeding 4 value heads, a non-zero state) against the torch recurrence (the
    decode step's kernel: test_ssm_cpu_kernels.py)."""
    ops = ssm_scan.load_kernels()
    if ops is None:
        pytest.skip("the recurrent-layer kernels could not be built here")
    torch.manual_seed(0)
    T, Hk, H, dk, dv = 40, 2, 4, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(T, Hk, dk), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(T, H, dv), -torch.rand(T, H), torch.rand(T, H)
    qh, kh = q.repeat_interleave(H // Hk, 1), k.repeat_interleave(H // Hk, 1)
    s0 = torch.randn(H, dk, dv)
    state, ref_state, ref = s0.clone(), s0[None], []
    out = ops.gated_delta_scan(q, k, v, g, beta, state)
    for t in range(T):
        o, ref_state = recurrent_step(qh[None, t], kh[None, t], v[None, t], g[None, t], beta[None, t], ref_state)
        ref.append(o[0])
    torch.testing.assert_close(out, torch.stack(ref), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state[0], atol=1e-4, rtol=1e-4)


def test_qwen3_5_moe_stacked_experts_load_like_per_expert_tensors(model_factory, tmp_path):
    """Qwen3.5's releases store each layer's experts stacked (experts.gate_up_proj [E, 2 * inter, H], experts.down_proj
    [E, H, inter]); transformers saves one tensor per expert. The same weights either way give transformers' tokens."""
    model = model_factory("qwen3_5_moe")
    stacked = shutil.copytree(model, tmp_path / "stacked")
    tensors = load_file(stacked / "model.safetensors")
    for layer in range(4):
        m = f"model.layers.{layer}.mlp.experts."
        gate, up, down = ([tensors.pop(f"{m}{e}.{name}.weight") for e in range(4)]
                          for name in ("gate_proj", "up_proj", "down_proj"))
        tensors[m + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[m + "down_proj"] = torch.stack(down)
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    with LLM(model=stacked, block_size=4, max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                           logprobs=5))
    check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS[:3], max_new=MAX_NEW)


def test_chunked_delta_rule_equals_the_recurrence():
    """The chunked prefill form (several chunks, a non-zero initial state) against the token-by-token recurrence."""
    torch.manual_seed(0)
    H, T, dk, dv = 3, 70, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(H, T, dk), dim=-1) for _ in range(2))
    v, beta = torch.randn(H, T, dv), torch.rand(H, T)
    g = -torch.rand(H, T)
    s0 = torch.randn(H, dk, dv)
    state = s0.clone()
    out = chunk_delta_rule(q, k, v, g, beta, state, chunk=16)
    ref_state, ref = s0[None], []
    for t in range(T):
        o, ref_state = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t],
                                      ref_state)
        ref.append(o[0])
    torch.testing.assert_close(out, torch.stack(ref, dim=1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state[0], atol=1e-4, rtol=1e-4)


def test_state_is_carved_from_the_cache_budget_and_max_num_seqs_refused(qwen3_next):
    with LLM(model=qwen3_next, block_size=4, max_model_len=64, kv_cache_memory=8 * 2**20, max_num_seqs=8) as llm:
        engine = llm.llm_engine
        runner = engine.executor.runner
        state = sum(c.nbytes for c in runner.kv_caches if isinstance(c, RecurrentState))
        # 8 sequences' slots and 8 prefix-cache checkpoints
        assert engine.state_bytes > 0 and state == 16 * engine.state_bytes == engine.num_state_slots * engine.state_bytes
        assert runner.kv_cache_bytes <= 8 * 2**20, "state and KV blocks together must stay within the budget"
        assert engine.pool.num_blocks == (8 * 2**20 - state) // runner.bytes_per_block(4)
    per_seq = engine.state_bytes
    budget = 40 * per_seq
    with pytest.raises(ValueError, match=r"--max-num-seqs 256 .* at most (\d+) sequences") as err:
        LLM(model=qwen3_next, block_size=4, max_model_len=64, kv_cache_memory=budget, max_num_seqs=256)
    fits = int(str(err.value).split("lower --max-num-seqs to ")[1].split()[0])
    assert 0 < fits < 40
    with LLM(model=qwen3_next, block_size=4, max_model_len=64, kv_cache_memory=budget, max_num_seqs=fits) as llm:
        assert llm.llm_engine.state_pool.num_slots == fits


# the recurrent families share the state slots and checkpoints: Gated DeltaNet, then Mamba2 and Mamba
# (test_hybrid_mamba.py)
STATE_FAMILIES = ["qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "qwen3_5", "jamba"]


@pytest.mark.parametrize("family", STATE_FAMILIES[:2])
def test_abort_mid_prefill_and_decode_frees_every_slot_and_block(model_factory, family):
    model = model_factory(family)
    with LLM(model=model, block_size=4, max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(6):  # some prompts still prefilling in chunks, some decoding, some waiting
            engine.step()
        assert engine.state_pool.num_free < engine.state_pool.num_slots
        engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
        assert not engine.has_unfinished_requests()
        engine.pool.check_all_free()
        engine.state_pool.check_all_free()
        # The slots come back clean: a prompt run after the aborts equals transformers.
        outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS[:2], max_new=MAX_NEW)


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_repeated_prompt_served_from_the_prefix_cache(model_factory, family):
    """A prompt's prefill is cut at its last full block, where the state is kept; the same prompt again (and a
    longer one sharing it) starts from there, at the attention layers' block size, equal to the uncached run and
    to transformers."""
    model = model_factory(family)
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    with LLM(model=model, block_size=4, max_model_len=128, max_num_batched_tokens=16) as llm:
        engine, tok = llm.llm_engine, llm.get_tokenizer()
        n = len(tok.encode(prompt))
        first = llm.generate([prompt], params)[0]
        assert first.num_cached_tokens == 0
        hits = engine.pool.prefix_hits
        again = llm.generate([prompt], params)[0]
        assert again.num_cached_tokens == (n - 1) // 4 * 4 > 0, "the repeated prompt was not served from the cache"
        assert engine.pool.prefix_hits - hits == again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        for a, b in zip(again.outputs[0].logprobs, first.outputs[0].logprobs):
            for tid, lp in a.items():
                assert lp.logprob == pytest.approx(b[tid].logprob, abs=1e-5)
        longer = tok.encode(prompt) + tok.encode(" and then the fish swam home")
        out = llm.generate([longer], params)[0]
        assert out.num_cached_tokens == (n - 1) // 4 * 4
        check_against_hf(model, tok, [again, out], [prompt, longer], max_new=MAX_NEW)
        engine.pool.check_all_free()
        engine.state_pool.check_all_free()


def _edited_copy(src, dst, **changes):
    """A copy of the model at src whose decoder's config (a vision-language checkpoint's text_config) has `changes`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.get("text_config", config).update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("changes,field", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention", "full_attention"]), "num_hidden_layers"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
])
def test_inconsistent_hybrid_config_refused_at_load(model_factory, family, tmp_path, changes, field):
    bad = _edited_copy(model_factory(family), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=field):
        LLM(model=bad, block_size=4, max_model_len=64)

