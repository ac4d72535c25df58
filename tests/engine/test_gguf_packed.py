"""GGUF weights served packed on CPU (quantization/gguf.py, layers/csrc/cpu_gguf.cpp).

- The kernel against the `gguf` package's dequantization + a float64 matmul, per type, odd shapes (rows not a
  multiple of anything, batch sizes 1..33 across the decode and the tiled prefill paths), at this machine's CPU
  tier and at the generic tier (a subprocess under SHOAL_CPU_ISA=generic, which builds the portable code).
- A model served packed equals the same file dequantized on load (SHOAL_GGUF_DEQUANTIZE=1): greedy tokens equal,
  logprobs within float32 reordering; on tiny files written here and on the real SmolLM2 Q4_1 GGUF when cached.
- Tensor-parallel slices of packed blocks: rows, and columns at block granularity (refused inside a block).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_fixtures import _random_k_blocks, write_gguf
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightError

pytestmark = pytest.mark.numerics

gguf = pytest.importorskip("gguf")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
BATCHES = (1, 2, 3, 4, 5, 7, 16, 17, 33)  # 1..16: the one-pass decode kernel (rows of 4 + remainders); >16 tiled
PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish", "def add(a, b):"]
MAX_NEW = 10
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def packed_rows(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of `qtype`: quantized random weights, or random K-quant blocks (gguf-py has no
    K quantizer) with realistic scales."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    rng = np.random.default_rng(seed)
    if qtype.endswith("_K"):
        return _random_k_blocks(rows, cols, QT[qtype], rng)
    return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), QT[qtype])


def check_kernel(qtype: str) -> str:
    """Assert the packed matmul and dequantization equal gguf-py's dequantization (+ a float64 matmul) for odd
    shapes and every batch size in BATCHES; returns the kernel's ISA line."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    from shoal.engine.execution.quantization.gguf import GGUFPacked, GGUFWeight, load_kernels

    block = 256 if qtype.endswith("_K") else 32
    for rows, cols in ((1, block), (37, 3 * block), (259, 2 * block)):
        raw = packed_rows(qtype, rows, cols, seed=rows)
        ref = torch.from_numpy(quants.dequantize(raw, QT[qtype]).astype(np.float32)).reshape(rows, cols)
        weight = GGUFWeight([GGUFPacked(torch.from_numpy(raw), qtype, cols)])
        assert torch.equal(weight.dequantize(), ref), (qtype, rows, cols)
        for batch in BATCHES:
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            expected = (x.double() @ ref.double().T).float()
            got = weight.matmul(x)
            assert got.shape == (batch, rows)
            # float32 sums of `cols` products in another order: relative to the sum of |products|
            bound = 1e-5 * (x.abs().double() @ ref.abs().double().T).float() + 1e-6
            assert ((got - expected).abs() <= bound).all(), (qtype, rows, cols, batch)
        ids = torch.tensor([[rows - 1, 0], [rows // 2, rows - 1]])
        assert torch.equal(weight.segments[0].dequantize_rows(ids), ref[ids])
    return load_kernels()[1]


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_kernel_matches_gguf_dequantize_native_tier(qtype):
    isa = check_kernel(qtype)
    from shoal.engine.execution.cpu_features import cpu_features

    if cpu_features().tier.startswith("avx"):  # the x86 SIMD tiers build the AVX2 path
        assert isa.startswith("avx2"), isa


def test_packed_kernel_matches_gguf_dequantize_generic_tier(tmp_path):
    """The portable build (no AVX2 intrinsics) at SHOAL_CPU_ISA=generic, every type, in a fresh process."""
    code = ("import sys; sys.path.insert(0, %r); import test_gguf_packed as t\n"
            "isa = [t.check_kernel(q) for q in t.TYPES][0]\n"
            "assert isa.startswith('portable'), isa\nprint('ok', isa)") % str(Path(__file__).parent)
    env = dict(os.environ, SHOAL_CPU_ISA="generic")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok portable" in done.stdout


def test_packed_weight_refuses_a_malformed_row():
    from shoal.engine.execution.quantization.gguf import GGUFPacked

    with pytest.raises(ValueError, match="Q4_1 rows must be uint8"):
        GGUFPacked(torch.zeros(3, 19, dtype=torch.uint8), "Q4_1", 32)
    with pytest.raises(ValueError, match="Q4_K rows must be uint8"):
        GGUFPacked(torch.zeros(3, 144, dtype=torch.uint8), "Q4_K", 128)


# ------------------------------------------------------------------------------------------- served models


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-packed")


def _generate(path: Path, monkeypatch, dequantize: bool, prompts=PROMPTS, max_new=MAX_NEW):
    from shoal.engine.execution.quantization import resident_weight_bytes
    from shoal.engine.execution.quantization.gguf import GGUFWeight

    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1" if dequantize else "0")
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=3)
    with LLM(model=str(path), **OPTIONS) as llm:
        model = llm.llm_engine.executor.runner.model
        packed = [m for m in model.modules() if isinstance(getattr(m, "quantized", None), GGUFWeight)]
        return llm.generate(prompts, params), packed, resident_weight_bytes(model)


def _assert_same(packed_out, dense_out, tol: float) -> None:
    for a, b in zip(packed_out, dense_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid in set(la) & set(lb):
                assert la[tid].logprob == pytest.approx(lb[tid].logprob, abs=tol)


@pytest.mark.parametrize("weight_type,embed_type", [("Q4_1", "Q8_0"), ("Q4_0", None), ("Q4_K", "Q6_K")])
def test_served_packed_equals_dequantized(model_factory, gguf_dir, monkeypatch, caplog, weight_type, embed_type):
    """SmolLM2's layout (tied LM head on a Q8_0 embedding, Q4_1 layers) and others: every matrix runs packed, the
    tied head on the embedding's own packed table, and the outputs equal the dequantized model's."""
    hf = model_factory("llama", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(hf, gguf_dir / f"tiny-{weight_type}-{embed_type}.gguf", weight_type=weight_type,
                      embed_type=embed_type)
    caplog.set_level("INFO", logger="shoal.engine.execution.quantization.gguf")
    packed_out, packed_layers, packed_bytes = _generate(path, monkeypatch, dequantize=False)
    assert "run packed" in caplog.text and "MiB of packed weights" in caplog.text
    dense_out, dense_layers, dense_bytes = _generate(path, monkeypatch, dequantize=True)
    # qkv, o, gate_up, down per layer + the LM head
    assert len(packed_layers) == 4 * SHAPE["num_hidden_layers"] + 1 and not dense_layers
    assert packed_bytes < 0.45 * dense_bytes  # 4-8 bit blocks instead of float32 (norms stay float32)
    _assert_same(packed_out, dense_out, tol=2e-4)


def test_smollm2_served_packed_equals_dequantized(monkeypatch):
    """The real SmolLM2-135M-Instruct Q4_1 file, when this machine has it cached."""
    from shoal.engine.tools.demo_model import find_demo_model

    path = find_demo_model()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is not cached here (shoal-engine demo fetches it)")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    packed_out, packed_layers, packed_bytes = _generate(path, monkeypatch, False, prompts, 16)
    dense_out, _, dense_bytes = _generate(path, monkeypatch, True, prompts, 16)
    assert packed_layers and packed_bytes <= 1.1 * path.stat().st_size
    _assert_same(packed_out, dense_out, tol=2e-3)


# ------------------------------------------------------------------------------------- tensor-parallel slices


def test_tensor_parallel_slices_of_packed_blocks(model_factory, gguf_dir):
    """A rank's rows are a byte range, its columns whole blocks; a split inside a block is refused by name."""
    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config

    hf = model_factory("llama", **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-tp-q4_1.gguf", weight_type="Q4_1")
    config = gguf_config(path)
    dense = GGUFWeightSource(path, config)
    packed = GGUFWeightSource(path, config, packed=True)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        full = dense.load(name)
        assert torch.equal(packed.load_packed(name).dequantize(), full)
        for dim in (0, 1):
            half = full.shape[dim] // 2
            part = packed.load_packed(name, dim=dim, start=half, length=half)
            assert torch.equal(part.dequantize(), full.narrow(dim, half, half)), (name, dim)
    with pytest.raises(WeightError, match=r"down_proj.*\(Q4_1\) would be split at columns \[16, 272\), inside its "
                                          r"blocks of 32"):
        packed.load_packed("model.layers.1.mlp.down_proj.weight", dim=1, start=16, length=256)
    assert packed.load_packed("model.layers.0.input_layernorm.weight") is None  # F32 norms load dense


def test_tensor_parallel_rank_serves_its_packed_slices(model_factory, gguf_dir):
    """A tp=2 rank 1 model built from packed slices computes what the same slices of the dense weights do."""
    from shoal.engine.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
    from shoal.engine.execution.gguf_model import gguf_config
    from shoal.engine.execution.layers.linear import PackedMatmul
    from shoal.engine.execution.model_loader import load_model

    hf = model_factory("llama", **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-tp-q8.gguf", weight_type="Q8_0")
    config = gguf_config(path)
    before = get_parallel_state()
    try:
        set_parallel_state(ParallelState(tp_rank=1, tp_size=2))
        packed = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=True)
        dense = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=False)
    finally:
        set_parallel_state(before)
    pairs = [(p, d) for (n, p), (_, d) in zip(packed.named_modules(), dense.named_modules())
             if isinstance(p, PackedMatmul)]
    assert pairs and all(p.quantized is not None for p, _ in pairs)
    for p, d in pairs:
        x = torch.randn(3, p.weight_shape[1])
        torch.testing.assert_close(p.matmul(x), d.matmul(x), rtol=1e-5, atol=1e-5)
