"""State-space hybrids (Mamba2 layers next to paged attention: Granite 4 = GraniteMoeHybrid, Nemotron-H, Falcon-H1
with both in every layer; Mamba (v1) layers: Jamba): transformers' greedy tokens and logprobs under every scheduling
regime, with the C++ selective scan and with the torch fallbacks; the scans against the recurrence, the state slots
freed on finish and preemption, and configs refused at load. Abort and prefix caching through the state checkpoints
are tested with Qwen3-Next's in test_hybrid.py, for every hybrid family."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.mamba2 import ssd_chunk_scan, ssm_step
from test_engine_correctness import PROMPTS, check_against_hf
from test_hybrid import _edited_copy

pytestmark = pytest.mark.numerics

MAX_NEW = 12
REGIMES = {
    "batched": dict(block_size=4, max_model_len=128),
    # 5-token chunks over 2-token blocks: chunk boundaries fall at every offset of the conv kernel's window (4)
    # and inside the prompts, each chunk carrying the conv and SSM state to the next.
    "odd-chunks": dict(block_size=2, max_model_len=128, max_num_batched_tokens=5),
    "preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=16),
}


FAMILIES = ["granitemoehybrid", "nemotron_h", "falcon_h1", "jamba"]


@pytest.fixture(scope="module")
def granite(model_factory):
    return model_factory("granitemoehybrid")


@pytest.fixture(scope="module", params=FAMILIES)
def mamba_hybrid(request, model_factory):
    return model_factory(request.param)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_mamba_hybrid_greedy_matches_transformers(mamba_hybrid, regime):
    with LLM(model=mamba_hybrid, **REGIMES[regime]) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate(PROMPTS, params)
        check_against_hf(mamba_hybrid, llm.get_tokenizer(), outputs, PROMPTS, max_new=MAX_NEW)
        engine = llm.llm_engine
        if regime == "preemption":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
        engine.pool.check_all_free()
        engine.state_pool.check_all_free()


@pytest.mark.parametrize("family", ["granitemoehybrid", "jamba"])
def test_torch_scan_fallback_matches_transformers(model_factory, monkeypatch, family):
    """Without the C++ scan (no compiler, or off CPU): Mamba2's chunked SSD form and Mamba's token loop, prompts
    split into odd chunks."""
    monkeypatch.setattr(ssm_scan, "load_kernels", lambda: None)
    model = model_factory(family)
    with LLM(model=model, **REGIMES["odd-chunks"]) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=5))
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS, max_new=MAX_NEW)
        llm.llm_engine.state_pool.check_all_free()


def test_granite_hybrid_with_rope_and_one_group_matches_transformers(model_factory):
    """The config switches the releases leave off: RoPE on the attention layers; one B/C group for all heads."""
    model = model_factory("granitemoehybrid", position_embedding_type="rope", mamba_n_groups=1)
    with LLM(model=model, block_size=4, max_model_len=128, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                           logprobs=5))
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS[:3], max_new=MAX_NEW)


@pytest.mark.parametrize("norm", [dict(mamba_rms_norm=False), dict(mamba_norm_before_gate=False)],
                         ids=["gate-only", "gate-then-norm"])
def test_falcon_h1_mamba_norm_placements_match_transformers(model_factory, norm):
    """Falcon-H1's other two Mamba norm placements (the tiny preset normalises before the gate)."""
    model = model_factory("falcon_h1", **norm)
    with LLM(model=model, block_size=4, max_model_len=128, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                           logprobs=5))
        check_against_hf(model, llm.get_tokenizer(), outputs, PROMPTS[:3], max_new=MAX_NEW)
        llm.llm_engine.state_pool.check_all_free()


def test_ssd_chunk_scan_equals_the_recurrence():
    """The chunked prefill form (several chunks, a non-zero initial state) against the token-by-token recurrence."""
    torch.manual_seed(0)
    T, H, P, N = 70, 3, 5, 8
    x, B, C = torch.randn(T, H, P), torch.randn(T, H, N), torch.randn(T, H, N)
    dt = torch.nn.functional.softplus(torch.randn(T, H))
    A = -torch.rand(H) * 2
    s0 = torch.randn(H, P, N)
    state = s0.clone()
    out = ssd_chunk_scan(x, dt, A, B, C, state, chunk=16)
    ref_state, ref = s0[None], []
    for t in range(T):
        y, ref_state = ssm_step(x[None, t], dt[None, t], A, B[None, t], C[None, t], ref_state)
        ref.append(y[0])
    torch.testing.assert_close(out, torch.stack(ref), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("decay", ["per-head", "per-state"])  # Mamba2's A [H], Mamba's A [channels, N]
def test_selective_scan_kernel_equals_the_recurrence(decay):
    """The C++ scan (several groups of heads, a non-zero initial state) against the torch recurrence."""
    if ssm_scan.load_kernels() is None:
        pytest.skip("the selective-scan kernel could not be built here")
    torch.manual_seed(0)
    T, H, P, N, G = (45, 6, 8, 16, 2) if decay == "per-head" else (45, 24, 1, 16, 1)
    x, dt = torch.randn(T, H, P), torch.nn.functional.softplus(torch.randn(T, H))
    A = -torch.rand(H, 1 if decay == "per-head" else N) * 2
    B, C, D, s0 = torch.randn(T, G, N), torch.randn(T, G, N), torch.randn(H, P), torch.randn(H, P, N)
    state, ref_state = s0.clone(), s0.clone()
    out = ssm_scan.selective_scan(x, dt, A, B, C, D, state)
    ref = ssm_scan.selective_scan_reference(x, dt, A, B, C, D, ref_state)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)
    if decay == "per-head":  # and the chunked SSD form agrees with both
        ssd_state = s0.clone()
        ssd = ssd_chunk_scan(x, dt, A[:, 0], B.repeat_interleave(H // G, 1), C.repeat_interleave(H // G, 1),
                             ssd_state, chunk=16) + x * D
        torch.testing.assert_close(ssd, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ssd_state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("decay", ["per-head", "per-state"])
def test_selective_state_update_kernel_equals_the_recurrence(decay):
    """The C++ decode step, in place on scattered slots, against the torch one; the slots not stepped are left
    alone."""
    if ssm_scan.load_kernels() is None:
        pytest.skip("the selective-scan kernel could not be built here")
    torch.manual_seed(1)
    S, H, P, N, G = (3, 6, 8, 16, 2) if decay == "per-head" else (3, 24, 1, 16, 1)
    x, dt = torch.randn(S, H, P), torch.nn.functional.softplus(torch.randn(S, H))
    A = -torch.rand(H, 1 if decay == "per-head" else N) * 2
    B, C, D = torch.randn(S, G, N), torch.randn(S, G, N), torch.randn(H, P)
    slots, pool = torch.tensor([4, 0, 2]), torch.randn(5, H, P, N)
    stepped = pool.clone()
    out = ssm_scan.selective_state_update(x, dt, A, B, C, D, stepped, slots)
    for i, slot in enumerate(slots.tolist()):
        ref_state = pool[slot].clone()
        ref = ssm_scan.selective_scan_reference(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, ref_state)
        torch.testing.assert_close(out[i], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stepped[slot], ref_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(stepped[[1, 3]], pool[[1, 3]])


def test_max_num_seqs_beyond_the_state_pool_refused(granite):
    with LLM(model=granite, block_size=4, max_model_len=64, max_num_seqs=2) as llm:
        per_seq = llm.llm_engine.state_bytes
    assert per_seq > 0
    with pytest.raises(ValueError, match=r"--max-num-seqs 256 .* at most (\d+) sequences") as err:
        LLM(model=granite, block_size=4, max_model_len=64, kv_cache_memory=40 * per_seq, max_num_seqs=256)
    fits = int(str(err.value).split("lower --max-num-seqs to ")[1].split()[0])
    with LLM(model=granite, block_size=4, max_model_len=64, kv_cache_memory=40 * per_seq, max_num_seqs=fits) as llm:
        assert llm.llm_engine.state_pool.num_slots == fits


@pytest.mark.parametrize("changes,message", [
    (dict(layer_types=["mamba", "mamba", "sliding_attention", "mamba"]), "layer_types"),
    (dict(layer_types=["mamba", "attention"]), "num_hidden_layers"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    # transformers' own config validation refuses it first (its message names the Mamba head dimensions)
    (dict(mamba_d_head=8), r"(?s)config.json: .*Mamba head"),
])
def test_inconsistent_granite_config_refused_at_load(granite, tmp_path, changes, message):
    bad = _edited_copy(granite, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=bad, block_size=4, max_model_len=64)


@pytest.mark.parametrize("changes,message", [
    (dict(layers_block_type=["mamba", "mlp", "attention", "moe", "mamba", "mlp"]), "'moe' blocks"),
    (dict(n_groups=3), "n_groups"),
])
def test_inconsistent_nemotron_h_config_refused_at_load(model_factory, tmp_path, changes, message):
    bad = _edited_copy(model_factory("nemotron_h"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=bad, block_size=4, max_model_len=64)


@pytest.mark.parametrize("changes,message", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(mamba_n_groups=4), "mamba_n_groups"),
    (dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
])
def test_inconsistent_falcon_h1_config_refused_at_load(model_factory, tmp_path, changes, message):
    bad = _edited_copy(model_factory("falcon_h1"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=bad, block_size=4, max_model_len=64)


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mamba_dt_rank=0), "mamba_dt_rank"),
])
def test_inconsistent_jamba_config_refused_at_load(model_factory, tmp_path, changes, message):
    bad = _edited_copy(model_factory("jamba"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=bad, block_size=4, max_model_len=64)


def test_jamba_checkpoint_without_the_inner_norms_refused_naming_the_tensor(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _edited_copy(model_factory("jamba"), tmp_path / "bad")
    (weights,) = bad.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.0.mamba.dt_layernorm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model\.layers\.0\.mamba\.dt_layernorm\.weight"):
        LLM(model=bad, block_size=4, max_model_len=64)
