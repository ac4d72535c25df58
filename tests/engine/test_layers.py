"""Layer-level properties the engine's speed tricks must not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.engine.execution.layers.linear import ColumnParallelLinear
from shoal.engine.execution.layers.weight_format import AmxBf16Weight, OneDNNBf16Weight, can_prepack, plain_format
from shoal.engine.distributed.parallel_state import layer_range

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_prepacked_bf16_linear_is_bit_identical(rows):
    """oneDNN's prepacked weight gives F.linear's bits; where the small-M kernel serves the weight instead (it
    keeps it plain), batches up to its MAX_ROWS are within one bf16 rounding of F.linear and larger ones exact;
    where AMX tiles serve it (their own layout), every batch is within one bf16 rounding."""
    from shoal.engine.execution.layers import amx_gemm, small_gemm

    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 160, bias=True, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight = layer.weight.data.clone()
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight, layer.bias)
    layer.use(plain_format(layer.weight))
    if amx_gemm.kernel_for(weight) is not None:
        assert isinstance(layer.format, AmxBf16Weight) and layer.weight.numel() == 0
        torch.testing.assert_close(layer(x), expected, rtol=2 ** -7, atol=1e-2)
        return
    if can_prepack(weight):
        assert isinstance(layer.format, OneDNNBf16Weight) and layer.weight.numel() == 0  # the unpacked copy is freed
    else:  # the small-M kernel, or a tier without native bf16 (oneDNN refuses the bf16 prepack): F.linear runs
        assert not isinstance(layer.format, OneDNNBf16Weight) and layer.weight.numel() == weight.numel()
    if small_gemm.kernel_for(weight) is not None and rows <= small_gemm.MAX_ROWS:
        torch.testing.assert_close(layer(x), expected, rtol=2 ** -7, atol=1e-2)
    else:
        assert torch.equal(layer(x), expected)


def test_bf16_prepack_follows_the_cpu_tier():
    from shoal.engine.execution.cpu_features import cpu_features
    from shoal.engine.execution.layers import small_gemm

    weight = torch.zeros(4, 4, dtype=torch.bfloat16)
    native = cpu_features().bf16_native and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_prepack(weight) == (native and small_gemm.kernel_for(weight) is None)
    assert not can_prepack(weight.float())


def test_fp32_weights_are_not_prepacked():
    layer = ColumnParallelLinear(8, 8, bias=False, dtype=torch.float32)
    layer.use(plain_format(layer.weight))
    assert not isinstance(layer.format, OneDNNBf16Weight) and layer.format.runs_on_parameter


def test_pipeline_layer_split():
    assert [layer_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [layer_range(10, r, 2, [3, 7]) for r in range(2)] == [(0, 3), (3, 10)]
    with pytest.raises(ValueError, match="cannot be split"):
        layer_range(2, 0, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "bloom", "gpt2"])
def test_pipeline_stages_hold_only_the_vocabulary_tables_they_use(model_factory, arch):
    """A middle stage holds no embedding and no LM head; the first embeds; the last projects (tied or not)."""
    from shoal.engine.execution.model_loader import load_hf_config, load_model
    from shoal.engine.distributed.parallel_state import ParallelState, using_parallel_state

    model_dir = model_factory(arch)
    hf_config = load_hf_config(model_dir)
    vocab_rows = {}
    for rank in range(3):
        with using_parallel_state(ParallelState(pp_rank=rank, pp_size=3)):
            model = load_model(model_dir, hf_config, torch.float32, torch.device("cpu"), None, 64)
        embed = next(m for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding")
        vocab_rows[rank] = (embed.weight.shape[0], model.lm_head.weight.shape[0])
    vocab = hf_config.vocab_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", True))
    assert vocab_rows[1] == (0, 0)
    assert vocab_rows[0][0] == vocab and vocab_rows[2][1] == vocab
    assert vocab_rows[2][0] == (vocab if tied else 0)  # a tied head reads the embedding table


@pytest.mark.parametrize("arch", ["llama", "bloom", "gpt2"])
def test_tensor_parallel_rank_reads_only_its_slices(model_factory, monkeypatch, arch):
    """No rank materialises the full weights: at tp=2 every sharded tensor is read as a half, and a rank reads
    about half of the checkpoint (norms and biases of row-parallel layers are replicated)."""
    from safetensors import safe_open

    from shoal.engine.execution import weights
    from shoal.engine.execution.model_loader import load_hf_config, load_model
    from shoal.engine.distributed.parallel_state import ParallelState, using_parallel_state

    heads = {"llama": {"num_attention_heads": 4, "num_key_value_heads": 2}, "bloom": {"n_head": 4}, "gpt2": {}}
    model_dir = model_factory(arch, **heads[arch])
    hf_config = load_hf_config(model_dir)
    full = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            full.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    reads: list[tuple[str, int]] = []
    original = weights.WeightSource.load

    def recording_load(self, name, *args, **kwargs):
        tensor = original(self, name, *args, **kwargs)
        reads.append((name, tensor.numel()))
        return tensor

    monkeypatch.setattr(weights.WeightSource, "load", recording_load)
    with using_parallel_state(ParallelState(tp_rank=1, tp_size=2)):
        load_model(model_dir, hf_config, torch.float32, torch.device("cpu"), None, 64)
    import math

    sizes = {name: math.prod(shape) for name, shape in full.items()}
    # Every matrix is split on some dimension, except GPT-2's small position table, which every rank keeps.
    big = {name for name, shape in full.items() if len(shape) == 2 and not name.endswith("wpe.weight")}
    for name, numel in reads:
        if name in big:
            assert numel <= sizes[name] // 2, f"{name}: read {numel} of {sizes[name]} elements at tp=2"
    assert sum(n for _, n in reads) < 0.6 * sum(sizes.values())
