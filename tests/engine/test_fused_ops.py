"""The fused CPU kernels (layers/fused.py) against the unfused torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.execution.layers import fused

pytestmark = pytest.mark.numerics

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    ops, why, _ = fused.load_kernels()
    if ops is None:
        pytest.skip(f"fused kernels unavailable: {why}")


def tol(dtype):
    # float32: only the order of a float32 sum differs. bf16/fp16: the kernels round where the reference rounds,
    # so an output may differ by one unit in the last place where a float32 sum or exp differs.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows take the multi-threaded path
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(dtype, rows, with_delta):
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    residual = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    ref_residual = residual.clone()
    ref = fused.add_rms_norm_reference(ref_residual, delta, weight, 1e-5)
    out = fused.add_rms_norm(residual, delta, weight, 1e-5)
    assert out.dtype == dtype and out.shape == ref.shape
    # The residual stream is updated exactly as the reference's add (or left alone without a delta).
    assert torch.equal(residual, ref_residual)
    torch.testing.assert_close(out, ref, **tol(dtype))
    if dtype == torch.bfloat16:  # same rounding steps: nearly every element identical to the last bit
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_gemma_norm_matches_transformers(dtype, rows, with_delta):
    """unit_offset: Gemma's (1 + w) norm, as transformers' Gemma3RMSNorm computes it, through the layer too."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from shoal.engine.execution.layers.norm import GemmaRMSNorm

    g = torch.Generator().manual_seed(rows + 1)
    hidden = 640
    residual = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype) if with_delta else None
    weight = (0.3 * torch.randn(hidden, generator=g)).to(dtype)
    hf = Gemma3RMSNorm(hidden, eps=1e-6).to(dtype)
    hf.weight.data.copy_(weight)
    expected_residual = residual + delta if with_delta else residual.clone()
    ref = hf(expected_residual)
    ours = GemmaRMSNorm(hidden, 1e-6, dtype)
    ours.weight.data.copy_(weight)
    out = ours.add_and_norm(residual, delta)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, ref, **tol(dtype))
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 0.01
    # unit_offset really is (1 + w): the plain norm of the same weights differs
    assert not torch.allclose(fused.add_rms_norm(residual.clone(), None, weight, 1e-6).float(), out.float(), atol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activations_match_reference(dtype, rows, act):
    fn, reference = {"silu": (fused.silu_and_mul, fused.silu_and_mul_reference),
                     "gelu_tanh": (fused.gelu_tanh_and_mul, fused.gelu_tanh_and_mul_reference)}[act]
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails and the zero
    ref = reference(x)
    out = fn(x)
    assert out.shape == (rows, 1536) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol(dtype))
    assert out[0, 1] == ref[0, 1] and (act == "silu" or out[0, 0] == 0)  # the tails as the reference has them
    if dtype == torch.bfloat16:
        differ = out != ref
        if act == "silu":
            assert differ.float().mean() < 0.01
        else:
            # Where x is well below 0, gelu is tiny and 1 + tanh cancels: there the last bit of tanh (ours vs
            # Sleef's) decides bf16's rounding. Elsewhere the bits agree.
            assert differ.float().mean() < 0.08
            assert not differ[x[:, :1536] > -1.0].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 16), (4, 4, 128)])
def test_rotary_matches_reference(dtype, heads, kv_heads, head_dim):
    from transformers import LlamaConfig

    from shoal.engine.execution.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 512, dtype)
    T = 13
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (T,), generator=g)
    ref = qkv.clone()
    fused.rotary_reference(ref, positions, rope.cos, rope.sin, heads + kv_heads, head_dim)
    rope.rotate_(positions, qkv, heads + kv_heads)
    torch.testing.assert_close(qkv, ref, **tol(dtype))
    v = slice((heads + kv_heads) * head_dim, None)
    assert not torch.equal(qkv[:, :v.start], qkv.new_zeros(T, v.start))
    if dtype != torch.float32:  # exact products and sums in float32, rounded where the reference rounds
        assert torch.equal(qkv, ref)


def test_rotary_rejects_a_position_outside_the_table():
    from transformers import LlamaConfig

    from shoal.engine.execution.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(LlamaConfig(), 16, 32, torch.float32)
    qkv = torch.zeros(2, 3 * 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rope.rotate_(torch.tensor([0, 32]), qkv, 2)


def test_reference_path_is_used_off_the_kernels_contract():
    """Inputs the kernels do not take (a non-contiguous feature axis) go to the reference, same result."""
    x = torch.randn(4, 64).t()  # stride(1) != 1
    weight = torch.ones(4)
    out = fused.add_rms_norm(x.clone(), None, weight, 1e-6)
    torch.testing.assert_close(out, fused.rms_norm_reference(x, weight, 1e-6))
