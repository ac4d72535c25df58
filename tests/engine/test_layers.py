"""Layer-level properties the engine's speed tricks must not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.engine.layers.linear import ColumnParallelLinear, can_prepack
from shoal.engine.parallel_state import layer_range


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_prepacked_bf16_linear_is_bit_identical(rows):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 160, bias=True, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight = layer.weight.data.clone()
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight, layer.bias)
    layer.prepack()
    if not can_prepack(weight):
        pytest.skip("oneDNN prepacking is not available in this torch build")
    assert layer.packed is not None and layer.weight.numel() == 0  # the unpacked copy is freed
    assert torch.equal(layer(x), expected)


def test_fp32_weights_are_not_prepacked():
    layer = ColumnParallelLinear(8, 8, bias=False, dtype=torch.float32)
    layer.prepack()
    assert layer.packed is None


def test_pipeline_layer_split():
    assert [layer_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [layer_range(10, r, 2, [3, 7]) for r in range(2)] == [(0, 3), (3, 10)]
    with pytest.raises(ValueError, match="cannot be split"):
        layer_range(2, 0, 3)
