"""The hybrids' Triton decode kernels (layers/ssm_triton.py) against the torch code they replace, under
TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it without a GPU): the causal conv1d update (with and without
bias), Gated DeltaNet's delta-rule step (gating and beta formed in the kernel) and Mamba2's SSM step (dt softplus,
bias, limits and the D skip in the kernel), each over several sequences whose state slots are scattered through
the pool (unsorted, non-contiguous), only those slots written; then the layers' decode path with the kernels forced
on equals their torch path over a few steps, and the engine's greedy tokens with them on are transformers'. Tiny
sizes: the interpreter is slow. On a GPU, one test runs the kernels compiled at the released models' sizes."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shoal.engine.execution.layers import ssm_triton
from shoal.engine.execution.layers.gated_delta_net import GatedDeltaNet, _l2norm, recurrent_step
from shoal.engine.execution.layers.mamba2 import Mamba2Mixer, Mamba2Shape, ssm_step

pytestmark = pytest.mark.skipif(ssm_triton.triton is None, reason="triton is not installed")

SLOTS = torch.tensor([5, 0, 3], dtype=torch.int64)  # unsorted, with gaps: slots 1, 2, 4, 6 must stay untouched
NUM_SLOTS = 7


def _conv_reference(x, conv_state, weight, bias, slots):
    window = torch.cat([conv_state[slots], x[:, :, None]], dim=-1)
    conv_state[slots] = window[:, :, 1:]
    conv = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        conv = conv + bias.float()
    return F.silu(conv).to(x.dtype)


def check_conv(with_bias, C=11, K=4, dtype=torch.float32, device="cpu", slots=SLOTS, num_slots=NUM_SLOTS, tol=1e-5,
               kernels=ssm_triton):
    torch.manual_seed(0)
    slots = slots.to(device)
    x = torch.randn(len(slots), 2 * C, device=device).to(dtype)[:, :C]  # a strided view, like in_proj's split
    state = torch.randn(num_slots, C, K - 1, device=device).to(dtype)
    weight = torch.randn(C, K, device=device).to(dtype)
    bias = torch.randn(C, device=device).to(dtype) if with_bias else None
    ref_state = state.clone()
    expected = _conv_reference(x, ref_state, weight, bias, slots)
    for _ in range(2):  # the second step reads the window the first wrote
        got = kernels.causal_conv1d_update(x, state, weight, bias, slots)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)  # a pure shift: exact, other slots intact
        x = torch.randn(len(slots), C, device=device).to(dtype)
        expected = _conv_reference(x, ref_state, weight, bias, slots)


@pytest.mark.parametrize("with_bias", [False, True])
def test_conv1d_update_matches_torch(with_bias):
    check_conv(with_bias)  # channels not a power of two: masked lanes


def check_gated_delta_rule(nk=2, ratio=2, dk=8, dv=6, device="cpu", slots=SLOTS, num_slots=NUM_SLOTS, tol=1e-5,
                           kernels=ssm_triton):
    """Value heads share key heads (ratio > 1), as in Qwen3-Next: the kernel must read key head h // ratio."""
    torch.manual_seed(1)
    slots = slots.to(device)
    Bn, H = len(slots), nk * ratio
    A_log, dt_bias = torch.randn(H, device=device) * 0.5, torch.randn(H, device=device)
    state = torch.randn(num_slots, H, dk, dv, device=device)
    ref = state.clone()
    for _ in range(2):
        channels = 2 * nk * dk + H * dv
        qkv = torch.randn(Bn, channels + 3, device=device)[:, :channels]  # a strided view
        ab = torch.randn(Bn, 2 * H, device=device) * 3  # a and b as strided views of one projection
        b, a = ab[:, :H], ab[:, H:]
        a[0, 0] = 25.0  # softplus past its threshold
        q, k, v = qkv.split([nk * dk, nk * dk, H * dv], dim=-1)
        q = _l2norm(q.reshape(Bn, nk, dk)) * dk ** -0.5
        k = _l2norm(k.reshape(Bn, nk, dk))
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        g = -A_log.exp() * F.softplus(a + dt_bias)
        o_ref, new = recurrent_step(q, k, v.reshape(Bn, H, dv), g, b.sigmoid(), ref[slots])
        ref[slots] = new
        o = kernels.gated_delta_rule_step(qkv, a, b, A_log, dt_bias, state, slots, nk)
        torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(state, ref, rtol=tol, atol=tol)


def test_gated_delta_rule_step_matches_torch():
    check_gated_delta_rule()


def check_mamba2(limit, groups=2, heads_per_group=2, P=4, N=5, device="cpu", slots=SLOTS, num_slots=NUM_SLOTS,
                 tol=1e-5, kernels=ssm_triton):
    """Several heads per B/C group: the kernel must read group h // heads_per_group."""
    torch.manual_seed(2)
    slots = slots.to(device)
    S, H = len(slots), groups * heads_per_group
    dt_bias, A, D = torch.randn(H, device=device), -torch.rand(H, device=device) - 0.1, torch.randn(H, device=device)
    state = torch.randn(num_slots, H, P, N, device=device)
    ref = state.clone()
    for _ in range(2):
        channels = H * P + 2 * groups * N
        xbc = torch.randn(S, channels + 2, device=device)[:, :channels]  # a strided view
        dt = torch.randn(S, 2 * H, device=device)[:, H:]
        dt[1, 2] = 30.0  # softplus past its threshold
        x, B, C = xbc.split([H * P, groups * N, groups * N], dim=-1)
        x = x.reshape(S, H, P)
        B = B.reshape(S, groups, N).repeat_interleave(heads_per_group, dim=1)
        C = C.reshape(S, groups, N).repeat_interleave(heads_per_group, dim=1)
        dts = F.softplus(dt + dt_bias).clamp(*limit)
        y_ref, new = ssm_step(x, dts, A, B, C, ref[slots])
        ref[slots] = new
        y_ref = y_ref + x * D[:, None]
        y = kernels.mamba2_ssm_step(xbc, dt, dt_bias, A, D, state, slots, groups, limit)
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(state, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.5)])
def test_mamba2_ssm_step_matches_torch(limit):
    check_mamba2(limit)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_compiled_on_cuda_at_release_sizes():
    """The released models' sizes (Qwen3-Next's 128 x 128 DeltaNet heads, Mamba2's 64 x 128 heads, thousands of
    conv channels in bfloat16), compiled, 64 sequences over a pool of 200 slots."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton runs interpreted in this process")
    slots = torch.randperm(200)[:64]
    check_conv(True, C=3000, K=4, dtype=torch.bfloat16, device="cuda", slots=slots, num_slots=200, tol=2e-2)
    check_gated_delta_rule(nk=4, ratio=2, dk=128, dv=128, device="cuda", slots=slots, num_slots=200, tol=1e-4)
    check_mamba2((0.0, math.inf), groups=2, heads_per_group=8, P=64, N=128, device="cuda", slots=slots,
                 num_slots=200, tol=1e-4)


def test_selection(monkeypatch):
    monkeypatch.delenv("SHOAL_SSM_TRITON", raising=False)
    monkeypatch.delenv("SHOAL_DISABLE_FUSED_OPS", raising=False)
    assert not ssm_triton.use_triton(torch.device("cpu"))  # the torch code on CPU by default
    assert ssm_triton.use_triton(torch.device("cuda"))
    monkeypatch.setenv("SHOAL_SSM_TRITON", "0")
    assert not ssm_triton.use_triton(torch.device("cuda"))
    monkeypatch.setenv("SHOAL_SSM_TRITON", "1")
    assert ssm_triton.use_triton(torch.device("cpu"))
    monkeypatch.setenv("SHOAL_DISABLE_FUSED_OPS", "1")
    assert not ssm_triton.use_triton(torch.device("cuda"))


# ---- the layers' decode path, kernels forced on against off

def _meta(slots, seq_lens):
    return SimpleNamespace(is_decode_only=True, state_slots=slots, query_lens_list=[1] * len(slots),
                           seq_lens_list=list(seq_lens))


def _random_params(layer):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def _decode_twice(layer, hidden, monkeypatch, steps=3, fused="triton"):
    """Run `steps` decode steps in torch, then with the `fused` kernels ("triton", or "cpu": the C++ ones), from the
    same state; the outputs and states must agree."""
    from shoal.engine.execution.layers import ssm_scan

    results = []
    for mode in ("torch", fused):
        monkeypatch.setenv("SHOAL_SSM_TRITON", "1" if mode == "triton" else "0")
        with monkeypatch.context() as m:
            if mode == "torch":
                m.setattr(ssm_scan, "load_kernels", lambda: None)
            results.append(_decode_steps(layer, hidden, steps))
    (o0, s0), (o1, s1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1.conv, s0.conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1.ssm, s0.ssm, rtol=1e-5, atol=1e-5)


def _decode_steps(layer, hidden, steps):
    torch.manual_seed(4)
    state = layer.allocate_state(NUM_SLOTS, "cpu")
    state.conv.normal_()
    state.ssm.normal_()
    outs = []
    for step in range(steps):
        h = torch.randn(len(SLOTS), hidden)
        # the second sequence starts at this step's first token: its slot is zeroed first
        seq_lens = [10 + step, 1 if step == 0 else 1 + step, 7 + step]
        outs.append(layer(h, None, state, _meta(SLOTS, seq_lens)))
    return torch.stack(outs), state


def test_gated_delta_net_decode_triton_equals_torch(monkeypatch):
    config = SimpleNamespace(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                             rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config, torch.float32)
    _random_params(layer)
    _decode_twice(layer, 16, monkeypatch)


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_decode_triton_equals_torch(monkeypatch, groups):
    shape = Mamba2Shape(hidden=16, heads=4, head_dim=4, groups=groups, d_state=8, conv_kernel=4, conv_bias=True,
                        proj_bias=False, eps=1e-5, norm_groups=groups, time_step_limit=(0.001, 2.0))
    layer = Mamba2Mixer(shape, torch.float32)
    _random_params(layer)
    _decode_twice(layer, 16, monkeypatch)


# ---- the engine, kernels forced on: greedy tokens and logprobs still transformers'

@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_hybrid_greedy_with_triton_decode_matches_transformers(model_factory, monkeypatch, family):
    from shoal.engine import LLM, SamplingParams
    from test_engine_correctness import PROMPTS, check_against_hf

    monkeypatch.setenv("SHOAL_SSM_TRITON", "1")
    model = model_factory(family)
    prompts = PROMPTS[:3]
    with LLM(model=model, block_size=4, max_model_len=64) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))
        check_against_hf(model, llm.get_tokenizer(), outputs, prompts, max_new=6)
        llm.llm_engine.state_pool.check_all_free()
