"""The AMX bf16 linear kernel (layers/amx_gemm.py): its weight layout everywhere, its results against a float64
reference on an AMX CPU (skipped elsewhere: no emulator ships here), and where the engine chooses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.engine.execution.cpu_features import cpu_features
from shoal.engine.execution.layers import amx_gemm
from shoal.engine.execution.layers.linear import ColumnParallelLinear
from shoal.engine.execution.layers.weight_format import AmxBf16Weight, plain_format

pytestmark = pytest.mark.numerics

needs_amx = pytest.mark.skipif(amx_gemm.load_kernel() is None, reason="no AMX tiles in this process")

# Rows: the vector path (1), a partial and a whole tile group (2, 15, 16), past one and two groups (17, 33), a
# 32-row pass plus a tail (50), and many passes with the panel split (300). Outputs: one block (16), an odd number
# of blocks (48: a pass with one weight tile), many. Inputs: one block and SmolLM2's widths.
ROWS = [1, 2, 3, 15, 16, 17, 33, 50, 300]
SHAPES = [(16, 32), (48, 96), (160, 576), (1040, 1536)]


def test_pack_and_unpack_are_inverse_and_lay_out_pairs():
    w = torch.arange(48 * 64, dtype=torch.float32).view(48, 64).to(torch.bfloat16)
    p = amx_gemm.pack(w)
    assert p.shape == (3, 2, 16, 32)
    # block (nb=1, kb=1), pair row kp=3, output n=5, j=1 is w[16 + 5][32 + 2*3 + 1]
    assert p[1, 1, 3, 2 * 5 + 1] == w[21, 39]
    assert torch.equal(amx_gemm.unpack(p), w)


def test_kernel_is_only_offered_for_tile_shaped_bf16_weights():
    assert amx_gemm.kernel_for(torch.zeros(16, 32)) is None  # float32
    assert amx_gemm.kernel_for(torch.zeros(20, 32, dtype=torch.bfloat16)) is None  # outputs not a multiple of 16
    assert amx_gemm.kernel_for(torch.zeros(16, 40, dtype=torch.bfloat16)) is None  # inputs not a multiple of 32
    offered = amx_gemm.kernel_for(torch.zeros(16, 32, dtype=torch.bfloat16)) is not None
    assert offered == (amx_gemm.load_kernel() is not None)
    if cpu_features().tier != "amx":
        assert not offered


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
def test_amx_linear_matches_float64_reference(n, k):
    """Every row count, with and without bias, rows contiguous or strided, is within one bf16 rounding of the
    float64 product of the same bf16 values."""
    ops = amx_gemm.load_kernel()
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = amx_gemm.pack(w)
    for m in ROWS:
        wide = torch.randn(m, k + 32, generator=g).to(torch.bfloat16)
        for x in (wide[:, :k].contiguous(), wide[:, 32:]):
            for b in (None, bias):
                ref = x.double() @ w.double().T + (0 if b is None else b.double())
                got = ops.linear(x, packed, b)
                assert got.dtype == torch.bfloat16 and got.shape == (m, n)
                torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 25, 50])
def test_float_out_is_the_bfloat16_result_widened(m):
    """float_out (an LM head's float32 logits) writes exactly the bfloat16 values, on the vector path (1 row) and the
    tiles, with and without bias: logits do not depend on which path wrote them."""
    ops = amx_gemm.load_kernel()
    g = torch.Generator().manual_seed(m)
    w = torch.randn(160, 576, generator=g).to(torch.bfloat16)
    bias = torch.randn(160, generator=g).to(torch.bfloat16)
    packed = amx_gemm.pack(w)
    x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        got = ops.linear(x, packed, b, True)
        assert got.dtype == torch.float32 and got.shape == (m, 160)
        assert torch.equal(got, ops.linear(x, packed, b).float())


@needs_amx
def test_lm_head_on_the_tiles_gives_the_logits_of_its_bfloat16_product():
    from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    g = torch.Generator().manual_seed(5)
    emb = VocabParallelEmbedding(320, 96, dtype=torch.bfloat16)
    emb.weight.data.copy_(torch.randn(emb.weight.shape, generator=g))
    head = ParallelLMHead(emb, tied=True)
    head.use(plain_format(head.weight), free_dense=False)
    assert isinstance(head.format, AmxBf16Weight)
    x = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (7, 320)
    assert torch.equal(logits, head.format.matmul(x).float())


@needs_amx
def test_amx_kernel_refuses_mismatched_inputs():
    ops = amx_gemm.load_kernel()
    packed = amx_gemm.pack(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        ops.linear(torch.zeros(1, 32), packed, None)
    with pytest.raises(RuntimeError, match="has 64 features, the weight 32"):
        ops.linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, torch.zeros(8, dtype=torch.bfloat16))


def test_engine_layers_take_the_amx_format_at_the_amx_tier_and_agree_with_f_linear():
    """plain_format chooses the tiles for a tile-shaped bf16 weight exactly where the kernel is available (freeing
    the Parameter), and a layer's output, for 2-D and 3-D inputs, stays within bf16 rounding of F.linear."""
    g = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(96, 160, bias=True, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(160, 96, generator=g))
    layer.bias.data.copy_(torch.randn(160, generator=g))
    weight = layer.weight.data.clone()
    layer.use(plain_format(layer.weight))
    chosen = isinstance(layer.format, AmxBf16Weight)
    assert chosen == (amx_gemm.load_kernel() is not None)
    if not chosen:
        pytest.skip("no AMX tiles here: the layer keeps the small-M kernel or oneDNN (tests/engine/test_layers.py)")
    assert layer.weight.numel() == 0 and torch.equal(layer.format.dequantize(), weight.float())
    for shape in ((1, 96), (7, 96), (2, 5, 96)):
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), weight.float(), layer.bias.float())
        got = layer(x)
        assert got.shape == (*shape[:-1], 160)
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=3e-2)


# ----------------------------------------------------------------------------------------- int8 W8A8 on the tiles

def test_int8_pack_lays_out_quads_and_unpacks():
    q = (torch.arange(32 * 128) % 251 - 125).to(torch.int8).view(32, 128)
    p = amx_gemm.pack(q)
    assert p.shape == (2, 2, 16, 64)
    # block (nb=1, kb=1), quad row kq=5, output n=3, j=2 is q[16 + 3][64 + 4*5 + 2]
    assert p[1, 1, 5, 3 * 4 + 2] == q[19, 86]
    assert torch.equal(amx_gemm.unpack(p), q)
    assert amx_gemm.int8_kernel_for(torch.zeros(16, 32, dtype=torch.int8)) is None  # inputs not a multiple of 64
    assert amx_gemm.int8_kernel_for(torch.zeros(24, 64, dtype=torch.int8)) is None  # outputs not a multiple of 16
    assert (amx_gemm.int8_kernel_for(torch.zeros(16, 64, dtype=torch.int8)) is not None) == \
        (amx_gemm.load_kernel() is not None)


@needs_amx
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 300])
@pytest.mark.parametrize("n,k", [(16, 64), (48, 128), (160, 576)])
def test_amx_int8_linear_is_the_exact_integer_product(m, n, k):
    """float32 out: (x quantized per row as quantize_rows_int8 does) @ q^T in exact integers, times the scales, to
    the last bit; bfloat16 out: the same rounded once; with weights and activations at +-127."""
    from shoal.engine.execution.quantization.int8 import quantize_rows_int8

    ops = amx_gemm.load_kernel()
    g = torch.Generator().manual_seed(m * n)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0], q[1] = 127, -127
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g) * 3
    x[0, :] = x[0, :].abs().max()  # a row whose every value quantizes to 127
    bias = torch.randn(n, generator=g)
    xq, xs = quantize_rows_int8(x)
    exact = (xq.double() @ q.double().t()).float()  # |sum| < 2**24: exact in float32
    ref = exact * ws * xs + bias
    got = ops.int8_linear(x, amx_gemm.pack(q), ws, bias)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    xb = x.bfloat16()
    xq, xs = quantize_rows_int8(xb)
    ref16 = ((xq.double() @ q.double().t()).float() * ws * xs + bias.bfloat16().float()).bfloat16()
    got16 = ops.int8_linear(xb, amx_gemm.pack(q), ws, bias.bfloat16())
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, ref16)


@needs_amx
def test_amx_int8_kernel_refuses_mismatched_inputs():
    ops = amx_gemm.load_kernel()
    packed = amx_gemm.pack(torch.zeros(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        ops.int8_linear(torch.zeros(1, 64, dtype=torch.float16), packed, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="has 128 features, the weight 64"):
        ops.int8_linear(torch.zeros(1, 128), packed, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="w_scale"):
        ops.int8_linear(torch.zeros(1, 64), packed, torch.ones(8), None)
    with pytest.raises(RuntimeError, match="packed int8 weight"):
        ops.int8_linear(torch.zeros(1, 64), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), None)


def test_int8_weight_takes_the_tiles_where_they_run_and_keeps_its_arithmetic():
    """Int8Weight on a tile-shaped layer uses the AMX kernel exactly where it is available, dequantizes to its
    weights, and gives the W8A8 arithmetic for float32, bfloat16 and float16 activations."""
    from shoal.engine.execution.quantization.int8 import Int8Weight, quantize_rows_int8

    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 128, generator=g)
    iw = Int8Weight.from_dense(w)
    assert (iw.amx is not None) == (amx_gemm.load_kernel() is not None)
    if iw.amx is None:
        pytest.skip("no AMX tiles here: oneDNN or torch._int_mm runs (tests/engine/test_quantization.py)")
    assert "AMX" in iw.kernel
    q, ws = quantize_rows_int8(w)
    torch.testing.assert_close(iw.dequantize(), q.float() * ws)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(2, 5, 128, generator=g).to(dtype)
        xq, xs = quantize_rows_int8(x.reshape(-1, 128))
        ref = ((xq.double() @ q.double().t()).float() * ws.reshape(-1) * xs).view(2, 5, 48)
        got = iw.matmul(x)
        assert got.dtype == dtype and got.shape == (2, 5, 48)
        torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
