"""The hybrids' C++ decode kernels on CPU (csrc/cpu_ssm.cpp through layers/ssm_scan.CpuDecode, the Triton kernels'
interface) against the torch code they replace, with test_hybrid_triton.py's checks: the causal conv1d update (with
and without bias, bfloat16 too), the delta-rule step and the Mamba2 step from the projections' outputs, over scattered
slots of which only those stepped change; then each recurrent layer's decode path with the kernels against its torch
path. The engines' greedy tokens with the kernels are checked against transformers in test_hybrid*.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.gated_delta_net import GatedDeltaNet
from shoal.engine.execution.layers.mamba import MambaMixer, MambaShape
from shoal.engine.execution.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from test_hybrid_triton import _decode_twice, _random_params, check_conv, check_gated_delta_rule, check_mamba2

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def cpu():
    ops = ssm_scan.load_kernels()
    if ops is None:
        pytest.skip("the recurrent-layer kernels could not be built here")
    return ssm_scan.CpuDecode(ops)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_update_matches_torch(cpu, with_bias, dtype):
    check_conv(with_bias, dtype=dtype, kernels=cpu, tol=1e-5 if dtype == torch.float32 else 2e-2)


def test_gated_delta_rule_step_matches_torch(cpu):
    check_gated_delta_rule(kernels=cpu)
    check_gated_delta_rule(nk=4, ratio=1, dk=16, dv=24, kernels=cpu)


@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.5)])
def test_mamba2_ssm_step_matches_torch(cpu, limit):
    check_mamba2(limit, kernels=cpu)


def test_decode_refuses_a_slot_outside_the_pool(cpu):
    state = torch.zeros(3, 4, 2)
    with pytest.raises(RuntimeError, match="slot 3 out of range"):
        cpu.causal_conv1d_update(torch.zeros(1, 4), state, torch.zeros(4, 3), None, torch.tensor([3]))


# ---- the layers' decode path, C++ against torch

def test_gated_delta_net_decode_cpu_equals_torch(cpu, monkeypatch):
    config = SimpleNamespace(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                             rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config, torch.float32)
    _random_params(layer)
    _decode_twice(layer, 16, monkeypatch, fused="cpu")


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_decode_cpu_equals_torch(cpu, monkeypatch, groups):
    shape = Mamba2Shape(hidden=16, heads=4, head_dim=4, groups=groups, d_state=8, conv_kernel=4, conv_bias=True,
                        proj_bias=False, eps=1e-5, norm_groups=groups, time_step_limit=(0.001, 2.0))
    layer = Mamba2Mixer(shape, torch.float32)
    _random_params(layer)
    _decode_twice(layer, 16, monkeypatch, fused="cpu")


def test_mamba_decode_cpu_equals_torch(cpu, monkeypatch):
    shape = MambaShape(hidden=16, inner=32, d_state=8, conv_kernel=4, dt_rank=4, conv_bias=True, proj_bias=False,
                       eps=1e-6)
    layer = MambaMixer(shape, torch.float32)
    _random_params(layer)
    with torch.no_grad():
        layer.A_log.copy_(torch.rand_like(layer.A_log))  # decays in (-e, -1): the state neither explodes nor dies
    _decode_twice(layer, 16, monkeypatch, fused="cpu")
