"""GGUF weights served packed on CPU (quantization/gguf.py, csrc/cpu_gguf.cpp, csrc/gguf_kernels.h).

- The kernels against the `gguf` package's dequantization + a float64 matmul, per type, odd shapes (rows not a
  multiple of anything, batch sizes 1..33 across the 16-bit-activation decode path and the tiled float32 prefill
  path), within the stated tolerance (assert_matches_reference): through the torch op at this machine's tier, and
  through a torch-free driver built with every x86 tier's flags this CPU can run and for ARM64 (NEON, SVE; run under
  qemu-aarch64 when installed).
- A model served packed equals the same file dequantized on load (SHOAL_GGUF_DEQUANTIZE=1): greedy tokens equal
  and logprobs close; on tiny files written here and on the real SmolLM2 Q4_1 GGUF when cached.
- Tensor-parallel slices of packed blocks: rows, and columns at block granularity (refused inside a block).
"""

from __future__ import annotations

import os
import shutil
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


def reference(qtype: str, raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight as gguf-py dequantizes it, each weight's offset): zeroing a block's quants leaves Q4_0's -8 d,
    Q4_1's m and Q4_K's -dmin mn, the part of a weight the kernels multiply by exact activation sums (0 for the
    other types)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    def dequantize(data: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(quants.dequantize(data, QT[qtype]).astype(np.float32)).reshape(rows, cols)

    quants_at = {"Q4_0": (18, 2, 18), "Q4_1": (20, 4, 20), "Q4_K": (144, 16, 144)}  # block size, quants' bytes
    if qtype not in quants_at:
        return dequantize(raw), torch.zeros(rows, cols)
    size, first, end = quants_at[qtype]
    blocks = raw.reshape(rows, -1, size).copy()
    blocks[..., first:end] = 0
    return dequantize(raw), dequantize(blocks.reshape(rows, -1))


QMAX = 32767  # decode activations: int16 per group of 32


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the decode kernels see it: each group of 32 rounded (ties to even) to steps of max|x| / QMAX."""
    groups = x.reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    return (torch.round(groups * inv).double() * (amax / QMAX).double()).reshape(x.shape)


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                             what) -> None:
    """y = x @ w.T from the packed kernels against float64 on gguf-py's weights.

    Stated tolerance: decode batches (<= 16 rows) quantize each activation group of 32 to int16 with scale
    d = max|x| / 32767, so an activation is at most d / 2 off; it multiplies the weight less its offset, so a row is
    off by at most the sum over groups of d / 2 * sum |w - offset|. Every path also sums float32 products in another
    order (1e-5 of sum |x w|). Decode batches are then checked tightly too, against the same sum over the
    activations rounded as the kernels round them."""
    expected = x.double() @ w.double().T
    reorder = 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6
    err = (got.double() - expected).abs()
    if x.shape[0] > 16:
        assert (err <= reorder).all(), what
        return
    d = x.reshape(x.shape[0], -1, 32).abs().amax(-1).double() / QMAX
    scaled = (w - offsets).reshape(w.shape[0], -1, 32).abs().sum(-1).double()
    assert (err <= (d / 2 @ scaled.T) * (1 + 1e-6) + reorder).all(), what
    emulated = quantized_activations(x) @ (w - offsets).double().T + x.double() @ offsets.double().T
    assert ((got.double() - emulated).abs() <= reorder).all(), what


def check_kernel(qtype: str) -> str:
    """The packed matmul op, its dequantization and its row lookup against gguf-py for odd shapes and every batch
    size in BATCHES; returns the kernel's ISA line."""
    from shoal.engine.execution.quantization.gguf import GGUFPacked, GGUFWeight, load_kernels

    block = 256 if qtype.endswith("_K") else 32
    for rows, cols in ((1, block), (37, 3 * block), (259, 2 * block)):
        raw = packed_rows(qtype, rows, cols, seed=rows)
        ref, offsets = reference(qtype, raw, rows, cols)
        weight = GGUFWeight([GGUFPacked(torch.from_numpy(raw), qtype, cols)])
        assert torch.equal(weight.dequantize(), ref), (qtype, rows, cols)
        for batch in BATCHES:
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            got = weight.matmul(x)
            assert got.shape == (batch, rows) and got.dtype == torch.float32
            assert_matches_reference(got, x, ref, offsets, (qtype, rows, cols, batch))
        ids = torch.tensor([[rows - 1, 0], [rows // 2, rows - 1]])
        assert torch.equal(weight.segments[0].dequantize_rows(ids), ref[ids])
    return load_kernels()[1]


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_kernel_matches_gguf_dequantize_native_tier(qtype):
    check_kernel(qtype)


def test_packed_matmul_fuses_segments_padding_bias_and_dtype():
    """A fused projection of segments of different types, zero rows past them (a vocabulary-parallel head's
    padding) and a bias, in one call; bfloat16 activations come back bfloat16."""
    from shoal.engine.execution.quantization.gguf import GGUFPacked, GGUFWeight

    parts = [("Q4_K", 7), ("Q6_K", 5), ("Q8_0", 3)]
    segments = [GGUFPacked(torch.from_numpy(packed_rows(q, n, 256, seed=n)), q, 256) for q, n in parts]
    weight = GGUFWeight(segments, out=17)
    dense = weight.dequantize()
    assert dense.shape == (17, 256) and not dense[15:].any()
    bias = torch.randn(17)
    for batch in (1, 3, 20):
        x = torch.randn(batch, 256)
        each = torch.cat([weight_of(s).matmul(x) for s in segments] + [torch.zeros(batch, 2)], dim=1)
        torch.testing.assert_close(weight.matmul(x, bias), each + bias, rtol=0, atol=1e-5)
        got = weight.matmul(x.bfloat16(), bias.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), x.bfloat16().float() @ dense.T + bias.bfloat16().float(),
                                   rtol=0.02, atol=0.02 * float(dense.abs().sum(1).max()))


def weight_of(segment):
    from shoal.engine.execution.quantization.gguf import GGUFWeight

    return GGUFWeight([segment])


# ------------------------------------------------------------------------------------ Triton kernels (GPU)


def triton_device() -> str:
    """Where the Triton kernels run in this process: CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1
    before triton's first import: tests/conftest.py sets it on machines without a GPU)."""
    from shoal.engine.execution.quantization import gguf_triton

    if gguf_triton.triton is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(gguf_triton._gguf_matmul_kernel, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU")
    return "cpu"


@pytest.mark.parametrize("qtype", TYPES)
def test_triton_kernels_match_gguf_dequantize(qtype):
    """The Triton matmul and row dequantization against gguf-py's dequantization + a float64 matmul: odd row counts,
    1 to 33 activation rows (one and two row tiles), float32 exact up to summation order."""
    from gguf import GGMLQuantizationType as QT

    from shoal.engine.execution.quantization import gguf_triton

    device = triton_device()
    block = 256 if qtype.endswith("_K") else 32
    for rows, cols in ((37, block), (5, 2 * block)):
        raw = packed_rows(qtype, rows, cols, seed=rows)
        ref, _ = reference(qtype, raw, rows, cols)
        data = torch.from_numpy(raw).to(device)
        assert torch.equal(gguf_triton.dequantize_rows(data, QT[qtype].value, cols).cpu(), ref)
        ids = torch.tensor([rows - 1, 0, rows // 2], device=device)
        assert torch.equal(gguf_triton.dequantize_rows(data, QT[qtype].value, cols, ids).cpu(), ref[ids.cpu()])
        for batch in (1, 3, 33):
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            got = gguf_triton.matmul(x.to(device), [(data, QT[qtype].value)], cols, rows).cpu()
            reorder = 1e-5 * (x.abs().double() @ ref.abs().double().T) + 1e-6
            assert ((got.double() - x.double() @ ref.double().T).abs() <= reorder).all(), (qtype, rows, cols, batch)


def test_triton_matmul_fuses_segments_padding_bias_and_dtype():
    """Segments of different types one after another, zero weights past them, the bias, bfloat16 activations."""
    from shoal.engine.execution.quantization import gguf_triton
    from shoal.engine.execution.quantization.gguf import GGUFPacked, GGUFWeight

    device = triton_device()
    parts = [("Q4_K", 7), ("Q6_K", 5), ("Q8_0", 3)]
    segments = [GGUFPacked(torch.from_numpy(packed_rows(q, n, 256, seed=n)), q, 256) for q, n in parts]
    dense = GGUFWeight(segments, out=17).dequantize()
    on_device = [(s.data.to(device), s.type_id) for s in segments]
    bias, x = torch.randn(17), torch.randn(3, 256)
    got = gguf_triton.matmul(x.to(device), on_device, 256, 17, bias.to(device)).cpu()
    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5, atol=1e-4)
    got = gguf_triton.matmul(x.bfloat16().to(device), on_device, 256, 17, bias.bfloat16().to(device)).cpu()
    assert got.dtype == torch.bfloat16  # TF32 products of the bfloat16 activations, rounded to bfloat16
    want = x.bfloat16().float() @ dense.T + bias.bfloat16().float()
    torch.testing.assert_close(got.float(), want, rtol=0.01, atol=0.01 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_served_packed_on_gpu_equals_dequantized(model_factory, gguf_dir, monkeypatch):
    """On CUDA the packed weights run through the Triton kernels: the same greedy tokens as the file dequantized."""
    from shoal.engine.execution.quantization.gguf import GGUFWeight

    hf = model_factory("llama", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-gpu-Q4_K-Q6_K.gguf", weight_type="Q4_K", embed_type="Q6_K")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = {}
    for dequantize in ("0", "1"):
        monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", dequantize)
        with LLM(model=str(path), device="cuda", **OPTIONS) as llm:
            layers = [m.format for m in llm.llm_engine.executor.runner.model.modules()
                      if isinstance(getattr(m, "format", None), GGUFWeight)]
            assert all("(triton)" in w.kernel for w in layers) and (dequantize == "1") != bool(layers)
            outs[dequantize] = llm.generate(PROMPTS, params)
    _assert_same(outs["0"], outs["1"], tol=5e-3)


# ------------------------------------------------------------------------------- every CPU tier's kernel code

DRIVER = Path(__file__).parent / "gguf_kernel_driver.cpp"
X86_ISA = {"generic": "portable", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512-vnni"}  # amx: the same
ARM_ISA = {"neon": "neon", "sve": "neon"}  # the SVE tier builds the NEON code (SVE's vectors add nothing here)


def driver_cases() -> list[tuple[str, np.ndarray, torch.Tensor]]:
    """(type, packed rows, activations): odd row counts, 1 to 5 activation rows (the four-row and remainder
    paths), both block sizes."""
    cases = []
    for qtype in TYPES:
        block = 256 if qtype.endswith("_K") else 32
        for rows, cols, batch in ((37, 3 * block, 1), (5, block, 3), (6, 2 * block, 5)):
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(rows + batch))
            cases.append((qtype, packed_rows(qtype, rows, cols, seed=rows), x))
    return cases


def run_driver(binary: list[str], cases, tmp_path: Path) -> str:
    """Run the built driver on every case and check its results as the op's; returns the ISA it reports."""
    from gguf import GGMLQuantizationType as QT

    with open(tmp_path / "in.bin", "wb") as f:
        for qtype, raw, x in cases:
            f.write(np.array([QT[qtype].value, raw.shape[0], x.shape[1], x.shape[0]], dtype=np.int32).tobytes())
            f.write(raw.tobytes())
            f.write(x.numpy().astype(np.float32).tobytes())
    proc = subprocess.run([*binary, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    at = 0
    for qtype, raw, x in cases:
        rows, (batch, cols) = raw.shape[0], x.shape
        y = torch.from_numpy(out[at:at + batch * rows].copy()).reshape(batch, rows)
        deq = torch.from_numpy(out[at + batch * rows:at + batch * rows + rows * cols].copy()).reshape(rows, cols)
        at += batch * rows + rows * cols
        ref, offsets = reference(qtype, raw, rows, cols)
        assert torch.equal(deq, ref), qtype
        assert_matches_reference(y, x, ref, offsets, (qtype, rows, cols, batch))
    assert at == out.size
    return proc.stdout.strip()


def build_driver(compiler: str, flags: list[str], out: Path, static: bool = False) -> Path:
    from shoal.engine.execution.native_build import INCLUDE_DIR

    cmd = [compiler, "-std=c++17", "-O3", *flags, f"-I{INCLUDE_DIR}", str(DRIVER), "-o", str(out)]
    proc = subprocess.run(cmd + (["-static"] if static else []), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("tier", list(X86_ISA))
def test_kernel_code_of_each_x86_tier(tier, tmp_path):
    """The kernels built with each x86 tier's flags (those this CPU can run), against gguf-py, every type."""
    from shoal.engine.execution.cpu_features import X86_TIERS, cpu_features, detect

    features = cpu_features()
    if features.arch != "x86_64":
        pytest.skip("x86 tiers run on x86 machines")
    if X86_TIERS.index(tier) > X86_TIERS.index(features.native_tier):
        pytest.skip(f"this CPU's tier is {features.native_tier}: it cannot run {tier} code")
    flags = detect(cap=tier, flags=features.flags, arch="x86_64").cflags
    binary = build_driver("c++", flags, tmp_path / "driver")
    assert run_driver([str(binary)], driver_cases(), tmp_path) == X86_ISA[tier]


@pytest.mark.parametrize("tier", list(ARM_ISA))
def test_kernel_code_of_each_arm64_tier(tier, tmp_path):
    """The kernels built for ARM64 with each ARM tier's flags (Debian's g++-aarch64-linux-gnu on x86) and run under
    qemu-aarch64 (qemu-user), against gguf-py, every type. On an ARM64 machine, built and run natively."""
    import platform

    from shoal.engine.execution.cpu_features import detect

    flags = detect(cap=tier, flags=frozenset({"asimd", "sve"}), arch="arm64").cflags
    native = platform.machine().lower() in ("aarch64", "arm64")
    compiler = shutil.which("c++" if native else "aarch64-linux-gnu-g++")
    if compiler is None:
        pytest.skip("no ARM64 compiler: apt-get install g++-aarch64-linux-gnu (and qemu-user to run the build)")
    binary = build_driver(compiler, flags, tmp_path / "driver", static=not native)
    assert binary.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF e_machine EM_AARCH64
    qemu = shutil.which("qemu-aarch64")
    if not native and qemu is None:
        pytest.skip("built for ARM64, but qemu-aarch64 is not installed to run it (apt-get install qemu-user)")
    runner = [str(binary)] if native else [qemu, str(binary)]
    assert run_driver(runner, driver_cases(), tmp_path) == ARM_ISA[tier]


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
        packed = [m for m in model.modules() if isinstance(getattr(m, "format", None), GGUFWeight)]
        maps = Path("/proc/self/maps")
        # the file is unmapped once loaded: its pages would stay resident next to the weights' copies
        assert not maps.exists() or str(Path(path).resolve()) not in maps.read_text()
        return llm.generate(prompts, params), packed, resident_weight_bytes(model)


def _assert_same(packed_out, dense_out, tol: float) -> None:
    """Logprobs within tol and the same greedy token at every step, until a step where the dense model's top two
    are within 2 tol (a near tie either side may win; past it the sequences part and nothing more is compared)."""
    for a, b in zip(packed_out, dense_out):
        steps = zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs)
        for ta, tb, la, lb in steps:
            for tid in set(la) & set(lb):
                assert la[tid].logprob == pytest.approx(lb[tid].logprob, abs=tol)
            first, second = sorted((v.logprob for v in lb.values()), reverse=True)[:2]
            if first - second <= 2 * tol:
                break
            assert ta == tb


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
    _assert_same(packed_out, dense_out, tol=5e-3)  # 16-bit activation groups: 0.0025 nats at most measured


def test_phi3_fused_projections_served_packed_equal_dequantized(model_factory, gguf_dir, monkeypatch):
    """Phi-3 keeps q/k/v and gate/up fused (attn_qkv, ffn_up); each part is read as a row range of the stored
    blocks, so those layers run packed too and give what the file dequantized on load gives."""
    hf = model_factory("phi3", hidden_size=192, intermediate_size=256, num_attention_heads=12,
                       num_key_value_heads=4)
    path = write_gguf(hf, gguf_dir / "tiny-phi3-q8.gguf", weight_type="Q8_0")
    packed_out, packed_layers, _ = _generate(path, monkeypatch, dequantize=False, prompts=PROMPTS[:2], max_new=6)
    dense_out, _, _ = _generate(path, monkeypatch, dequantize=True, prompts=PROMPTS[:2], max_new=6)
    assert len(packed_layers) == 4 * 3 + 1  # qkv, o, gate_up, down in each of the 3 layers + the LM head
    _assert_same(packed_out, dense_out, tol=5e-3)


def test_deepseek_served_packed_equals_dequantized(model_factory, gguf_dir, monkeypatch):
    """A Q8_0 deepseek2 file (MLA): the latent projections run packed, their rotary rows reordered on load as whole
    byte rows, and give what the same file dequantized on load gives. (Against its F32 file this random model moves
    up to 0.83 nats: a near-tie in the router flips an expert, so that is no test of the packed path.)"""
    from gguf_fixtures import write_mla_gguf

    path = write_mla_gguf(model_factory("deepseek_v3"), gguf_dir / "tiny-deepseek-q8.gguf", weight_type="Q8_0")
    packed_out, packed_layers, _ = _generate(path, monkeypatch, dequantize=False)
    dense_out, dense_layers, _ = _generate(path, monkeypatch, dequantize=True)
    assert packed_layers and not dense_layers
    _assert_same(packed_out, dense_out, tol=5e-3)


def test_quantization_flag_applies_to_what_is_not_packed(model_factory, gguf_dir):
    """--quantization int8 on a GGUF file: the packed Q8_0 embedding and tied head stay as they are, the Q5_K layers
    (no packed kernel: dequantized on load) are quantized to int8, and the model still runs."""
    from shoal.engine.execution.quantization.gguf import GGUFWeight
    from shoal.engine.execution.quantization.base import QuantizedWeight
    from shoal.engine.execution.quantization.int8 import Int8Weight

    hf = model_factory("llama", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-Q5_K-Q8_0.gguf", weight_type="Q5_K", embed_type="Q8_0")
    with LLM(model=str(path), quantization="int8", **OPTIONS) as llm:
        kinds = {type(m.format) for m in llm.llm_engine.executor.runner.model.modules()
                 if isinstance(getattr(m, "format", None), QuantizedWeight)}
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert kinds == {GGUFWeight, Int8Weight} and len(out[0].outputs[0].token_ids) == 4


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
    _assert_same(packed_out, dense_out, tol=0.02)  # 30 layers of reordered float32 sums: 0.009 nats at most measured


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
    from shoal.engine.distributed.parallel_state import ParallelState, using_parallel_state
    from shoal.engine.execution.gguf_model import gguf_config
    from shoal.engine.execution.layers.linear import PackedMatmul
    from shoal.engine.execution.model_loader import load_model
    from shoal.engine.execution.quantization.base import QuantizedWeight

    hf = model_factory("llama", **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-tp-q8.gguf", weight_type="Q8_0")
    config = gguf_config(path)
    with using_parallel_state(ParallelState(tp_rank=1, tp_size=2)):
        packed = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=True)
        dense = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=False)
    pairs = [(p, d) for (n, p), (_, d) in zip(packed.named_modules(), dense.named_modules())
             if isinstance(p, PackedMatmul)]
    assert pairs and all(isinstance(p.format, QuantizedWeight) for p, _ in pairs)
    for p, d in pairs:
        x = torch.randn(17, p.weight_shape[1])  # 17 rows: the float32 tiled path, exact up to summation order
        torch.testing.assert_close(p.matmul(x), d.matmul(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- packed expert stacks

MOE_SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE_FAMILIES = {  # K-quant rows need multiples of 256 input features: hidden and expert width 256
    "mixtral": dict(intermediate_size=256),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256, mlp_only_layers=None),
    "qwen3_moe": dict(moe_intermediate_size=256, mlp_only_layers=None, head_dim=64),
}


@pytest.mark.parametrize("arch,weight_type", [("mixtral", "Q4_K"), ("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q6_K")])
def test_moe_served_packed_equals_dequantized(model_factory, gguf_dir, monkeypatch, caplog, arch, weight_type):
    """Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE GGUF files: every expert stack stays packed and runs through
    the fused MoE kernel's packed loop; outputs equal the dequantized model's."""
    from shoal.engine.execution.layers.moe import FusedMoE
    from shoal.engine.execution.quantization.gguf import GGUFExperts

    hf = model_factory(arch, **MOE_SHAPE, **MOE_FAMILIES[arch])
    path = write_gguf(hf, gguf_dir / f"tiny-{arch}-{weight_type}.gguf", weight_type=weight_type)
    caplog.set_level("INFO", logger="shoal.engine.execution.quantization.gguf")
    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "0")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with LLM(model=str(path), **OPTIONS) as llm:
        experts = [m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
        assert len(experts) == 2 and all(isinstance(m.format, GGUFExperts) and not m.w13.numel() for m in experts)
        packed_out = llm.generate(PROMPTS, params)
    assert "the experts of 2 MoE layer(s) run packed" in caplog.text
    dense_out, _, _ = _generate(path, monkeypatch, dequantize=True)
    _assert_same(packed_out, dense_out, tol=5e-3)  # 16-bit activation groups: 0.0025 nats at most measured


@pytest.mark.parametrize("qtypes", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_1", "Q4_0")])
def test_packed_expert_loop_equals_expert_by_expert(qtypes):
    """fused_experts_gguf against the grouped torch loop over the same packed weights (layers/moe.py), one expert at
    a time: routing, SiLU(gate) * up, the weighted sum and the expert range of this rank; 1 to 40 tokens (decode and
    tiled paths)."""
    from shoal.engine.execution.layers.moe import grouped_experts, load_cpu_kernel
    from shoal.engine.execution.quantization.gguf import PACKED_TYPES, GGUFPacked, GGUFWeight

    E, H, I, start = 5, 256, 256, 2  # this rank holds experts 2..6 of 8
    stacks = [np.stack([packed_rows(q, rows, cols, seed=10 * e + k) for e in range(E)])
              for k, (q, rows, cols) in enumerate(zip(qtypes, (I, I, H), (H, H, I)))]
    per_expert = [(GGUFWeight([GGUFPacked(torch.from_numpy(stacks[0][e]), qtypes[0], H),
                               GGUFPacked(torch.from_numpy(stacks[1][e]), qtypes[1], H)]),
                   GGUFWeight([GGUFPacked(torch.from_numpy(stacks[2][e]), qtypes[2], I)])) for e in range(E)]

    def expert(e, xs):
        h = per_expert[e][0].matmul(xs)
        return per_expert[e][1].matmul(torch.nn.functional.silu(h[:, :I]) * h[:, I:])

    ops = load_cpu_kernel()[0]
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, H)
        weights, ids = torch.rand(tokens, 2).softmax(-1), torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
        got = ops.fused_experts_gguf(x, *(torch.from_numpy(s) for s in stacks), *(PACKED_TYPES[q][0] for q in qtypes),
                                     weights, ids, start)
        want = grouped_experts(x, weights, ids, start, E, expert)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    half = ops.fused_experts_gguf(x.bfloat16(), *(torch.from_numpy(s) for s in stacks),
                                  *(PACKED_TYPES[q][0] for q in qtypes), weights, ids, start)
    assert half.dtype == torch.bfloat16  # computed in float32 from the rounded activations, rounded once at the end
    torch.testing.assert_close(half.float(), grouped_experts(x.bfloat16().float(), weights, ids, start, E, expert),
                               rtol=0.01, atol=0.01)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-slices", "expert-parallel"])
def test_tensor_parallel_rank_serves_its_packed_experts(model_factory, gguf_dir, expert_parallel):
    """A tp=2 rank 1 of a Qwen2-MoE GGUF: its experts' packed slices (intermediate rows and down's columns on block
    boundaries, or whole experts) compute what the same slices of the dequantized stacks do."""
    from shoal.engine.distributed.parallel_state import ParallelState, using_parallel_state
    from shoal.engine.execution.gguf_model import gguf_config
    from shoal.engine.execution.layers.moe import FusedMoE
    from shoal.engine.execution.quantization.gguf import GGUFExperts
    from shoal.engine.execution.model_loader import load_model

    hf = model_factory("qwen2_moe", **MOE_SHAPE, **MOE_FAMILIES["qwen2_moe"])
    path = write_gguf(hf, gguf_dir / "tiny-qwen2_moe-tp-Q4_0.gguf", weight_type="Q4_0")
    config = gguf_config(path)
    with using_parallel_state(ParallelState(tp_rank=1, tp_size=2, expert_parallel=expert_parallel)):
        packed = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=True)
        dense = load_model(path, config, torch.float32, torch.device("cpu"), None, 64, gguf_packed=False)
    pairs = [(p, d) for p, d in zip(packed.modules(), dense.modules()) if isinstance(p, FusedMoE)]
    assert pairs and all(isinstance(p.format, GGUFExperts) for p, _ in pairs)
    torch.manual_seed(0)
    for p, d in pairs:
        # 96 tokens over 4 experts: each expert's batch (> 16) takes the float32 tiled path, exact up to sum order
        x = torch.randn(96, p.hidden)
        weights, ids = torch.rand(96, 2).softmax(-1), torch.stack([torch.randperm(4)[:2] for _ in range(96)])
        assert torch.bincount(ids.flatten(), minlength=4).min() > 16
        torch.testing.assert_close(p(x, weights, ids), d(x, weights, ids), rtol=1e-4, atol=1e-5)
