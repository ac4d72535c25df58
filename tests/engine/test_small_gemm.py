"""The small-M linear kernel (layers/small_gemm.py) against a float64 torch reference, at this machine's tier and,
in a subprocess each, at the x86 tiers below it that take their own code path (AVX2, AVX-512F without BF16)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shoal.engine.execution.cpu_features import cpu_features
from shoal.engine.execution.layers import small_gemm
from shoal.engine.execution.layers.linear import ColumnParallelLinear
from shoal.engine.execution.layers.weight_format import SmallGemmWeight, plain_format

pytestmark = pytest.mark.numerics

# M up to MAX_ROWS; N not a multiple of the 4-row micro kernel or the 16-row blocks; K not a multiple of 8, 16 or 32.
SHAPES = [(1, 576, 576), (1, 7, 13), (2, 33, 100), (3, 61, 1536), (4, 20, 64), (5, 17, 31), (9, 130, 576),
          (32, 50, 200)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if small_gemm.load_kernel() is None:
        pytest.skip("the small-M kernel could not be built here")


def check(dtype: torch.dtype, shapes=SHAPES) -> None:
    """Every shape, with and without bias, rows strided or not, equals the float64 product of the same values
    rounded once to dtype (float32: to float32 summation error; bfloat16: within one rounding of the output)."""
    kernel = small_gemm.load_kernel()
    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        w = torch.randn(n, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        wide = torch.randn(m, k + 5, generator=g).to(dtype)
        for x in (wide[:, :k].contiguous(), wide[:, 3:3 + k]):  # contiguous, then rows 8 elements apart
            for b in (None, bias):
                ref = x.double() @ w.double().T + (0 if b is None else b.double())
                got = kernel(x, w, b)
                assert got.dtype == dtype and got.shape == (m, n)
                if dtype == torch.float32:
                    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
                else:  # bf16 keeps 8 bits: one rounding of the output is 2^-8 relative
                    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_matches_float64_reference(dtype):
    check(dtype)


def test_linear_layers_route_small_batches_to_the_kernel_and_keep_results():
    """A layer sends up to MAX_ROWS rows through the kernel and more through torch; both agree with F.linear, and
    a bfloat16 weight stays plain (not oneDNN-prepacked) so the kernel can read it."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        layer = ColumnParallelLinear(96, 40, bias=True, dtype=dtype)
        layer.weight.data.copy_(torch.randn(40, 96, generator=g))
        layer.bias.data.copy_(torch.randn(40, generator=g))
        layer.use(plain_format(layer.weight))
        assert isinstance(layer.format, SmallGemmWeight) and layer.weight.numel()
        for rows in (1, small_gemm.MAX_ROWS, small_gemm.MAX_ROWS + 1):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
            torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                       atol=5e-2 if dtype == torch.bfloat16 else 1e-4)
        assert layer.format.small_kernel is small_gemm.load_kernel()


def test_kernel_refuses_mismatched_inputs():
    kernel = small_gemm.load_kernel()
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="w \\[N, K\\]"):
        kernel(torch.ones(1, 4), torch.ones(3, 5), None)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        kernel(torch.ones(1, 4, dtype=torch.float16), torch.ones(3, 4, dtype=torch.float16), None)


_TIERS_BELOW = [t for t in ("avx2", "avx512") if cpu_features().arch == "x86_64" and cpu_features().at_least(t)
                and t != cpu_features().tier]


@pytest.mark.parametrize("tier", _TIERS_BELOW or [pytest.param("avx2", marks=pytest.mark.skip(
    reason="no x86 tier with its own path below this machine's"))])
def test_small_gemm_at_lower_x86_tiers(tier):
    """The AVX2 and AVX-512F builds (their own loads, tails and reductions) on this machine, capped."""
    code = ("import sys, torch; sys.path.insert(0, %r); from test_small_gemm import check; "
            "from shoal.engine.execution.layers import small_gemm; "
            "from shoal.engine.execution.cpu_features import cpu_features; "
            "assert small_gemm.load_kernel() is not None; check(torch.float32); check(torch.bfloat16); "
            "print('TIER' + cpu_features().tier)") % str(__import__("pathlib").Path(__file__).parent)
    env = dict(__import__("os").environ, SHOAL_CPU_ISA=tier)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"TIER{tier}" in proc.stdout, json.dumps(proc.stdout[-500:])
