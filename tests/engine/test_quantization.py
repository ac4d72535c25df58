"""`--quantization int8|int4|fp8` on load: kernels against dense math, the whole engine against the unquantized
model on a seeded workload (bounded logprob error), and int4 exactly equal to a dense model that holds the same
dequantized weights."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers.linear import PackedMatmul
from shoal.engine.execution.quantization import METHODS, QuantizationError, check_supported
from shoal.engine.execution.quantization.base import QuantizedWeight
from shoal.engine.execution.quantization.int4 import Int4Weight
from shoal.engine.execution.quantization.int8 import Int8Weight, quantize_rows_int8

pytestmark = pytest.mark.numerics

PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish", "def add(a, b):",
           "Kubernetes runs pods on nodes", "numbers 0 1 2 3 4 5 6 7", "What is the capital of France?",
           "A paged cache keeps keys and values", "Continuous batching lets requests join"]
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4)
# Shapes the kernels must take: odd row counts (decode batches), widths of the tiny models and real ones.
SHAPES = [(1, 96, 160), (5, 160, 96), (32, 256, 512), (7, 576, 1536)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_w8a8_matches_dense_within_quantization_error(m, k, n, dtype):
    torch.manual_seed(0)
    w, x, b = torch.randn(n, k) * 0.05, torch.randn(m, k), torch.randn(n) * 0.1
    q = Int8Weight.from_dense(w.to(dtype))
    y = q.matmul(x.to(dtype), b.to(dtype)).float()
    ref = x @ w.t() + b
    assert y.shape == (m, n) and y.dtype == torch.float32
    rel = (y - ref).norm() / ref.norm()
    assert rel < (0.02 if dtype == torch.float32 else 0.03), rel
    assert q.nbytes() < w.numel() * 1.1  # one byte per weight plus scales


@pytest.mark.parametrize("m", [1, 5, 32, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cpu_kernel_equals_the_torch_ops_it_replaces(m, dtype):
    """The fused C++ op (oneDNN-prepacked weight, per-token quantization, one epilogue) computes the same W8A8
    arithmetic as quantize_rows_int8 + torch._int_mm + scaling; only the float32 product order differs."""
    from shoal.engine.execution.quantization.int8 import quantize_rows_int8

    torch.manual_seed(2)
    w, x, b = torch.randn(96, 160) * 0.05, torch.randn(m, 160).to(dtype), (torch.randn(96) * 0.1).to(dtype)
    q = Int8Weight.from_dense(w.to(dtype))
    assert q.packed is not None and "oneDNN" in q.kernel  # the CPU path, not the fallback
    wq, ws = quantize_rows_int8(w.to(dtype), Int8Weight.weight_limit(torch.device("cpu")))
    assert torch.equal(q.dequantize(), wq.float() * ws)  # the packed layout holds exactly the quantized weight
    xq, xs = quantize_rows_int8(x)
    ref = (torch._int_mm(xq, wq.t().contiguous()).float() * xs * ws.view(1, -1) + b.float()).to(dtype)
    got = q.matmul(x, b)
    assert got.dtype == dtype and got.shape == (m, 96)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    # a strided row view (a slice of a fused projection) and a 3-D batch take the same path
    wide = torch.cat([x, x], dim=1)[:, :160]
    torch.testing.assert_close(q.matmul(wide, b), got)
    torch.testing.assert_close(q.matmul(x.unsqueeze(0), b)[0], got)


@pytest.mark.parametrize("m", [1, 4, 33])
def test_int8_sums_that_overflow_int16_pairs_stay_exact(m):
    """Activations at +127 (u8 255 after the zero point) against weights at the top of their range: each byte
    pair sums to 2 * 255 * 127 = 64770 at 8 bits, which a CPU without VNNI clips to 32767 (vpmaddubsw). The kernel
    must give the exact product whatever the CPU: 7-bit weights there, 8-bit with VNNI."""
    k, n = 256, 48
    w = torch.ones(n, k)
    w[1::2] = -1.0  # both signs of saturation
    w[2] = torch.linspace(-1, 1, k)  # and a row of mixed magnitudes
    x = torch.ones(m, k)
    x[:, ::3] = 0.5
    q = Int8Weight.from_dense(w)
    limit = Int8Weight.weight_limit(torch.device("cpu"))
    assert torch.equal(q.dequantize(), quantize_rows_int8(w, limit)[0].float() * quantize_rows_int8(w, limit)[1])
    got = q.matmul(x)
    xq, xs = quantize_rows_int8(x)
    wq, ws = quantize_rows_int8(w, limit)
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double().view(1, -1)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got[:, :2], (x @ w.t())[:, :2], rtol=1e-2, atol=1e-2)


def test_int8_weights_the_cpu_kernel_would_saturate_are_refused():
    limit = Int8Weight.weight_limit(torch.device("cpu"))
    if limit == 127:
        pytest.skip("this CPU tier has VNNI: every int8 weight sums exactly")
    with pytest.raises(ValueError, match="saturate"):
        Int8Weight(torch.full((4, 8), 100, dtype=torch.int8), torch.ones(4))


@pytest.mark.parametrize("tied", [False, True])
def test_int8_keeps_the_lm_head_dense_quantizes_an_untied_embedding_and_cuts_weight_memory(model_factory, tied):
    """The LM head stays in the model's dtype (as vLLM's W8A8 keeps it: per-token rounding of the final hidden
    state costs the most quality there); an untied embedding table is stored as int8 rows, a tied one stays the
    head's dense table."""
    from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from shoal.engine.execution.quantization import resident_weight_bytes

    model = model_factory("llama", hidden_size=192, intermediate_size=256, vocab_size=2048,
                          tie_word_embeddings=tied)
    options = dict(OPTIONS, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=8, seed=0)
    with LLM(model=model, **options) as llm:
        dense_net = llm.llm_engine.executor.runner.model
        dense_bytes = resident_weight_bytes(dense_net)
        ref = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    with LLM(model=model, quantization="int8", **options) as llm:
        net = llm.llm_engine.executor.runner.model
        heads = [m for m in net.modules() if isinstance(m, ParallelLMHead)]
        tables = [m for m in net.modules() if isinstance(m, VocabParallelEmbedding)]
        layers = [m for m in net.modules() if isinstance(m, PackedMatmul) and not isinstance(m, ParallelLMHead)]
        assert heads and all(not isinstance(h.format, QuantizedWeight) for h in heads)
        assert layers and all(isinstance(m.format, Int8Weight) for m in layers)
        if tied:
            assert tables and all(t.int8_rows is None and t.weight.numel() for t in tables)
        else:
            assert tables and all(t.int8_rows is not None and not t.weight.numel() for t in tables)
        int8_bytes = resident_weight_bytes(net)
        got = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    # The linear layers' weights are one byte instead of two; the head (and a tied table) stays bf16.
    assert int8_bytes < dense_bytes * (0.85 if tied else 0.7), (int8_bytes, dense_bytes)
    mean, worst = _logprob_error(ref, got)
    # Without VNNI the weights are 7-bit (see quantization/int8.py): twice the rounding step, ~1.4x the error.
    slack = 1.0 if Int8Weight.weight_limit(torch.device("cpu")) == 127 else 1.5
    assert mean < 0.25 * slack and worst < 1.0 * slack, (mean, worst)


def test_int8_embedding_lookup_reads_the_quantized_rows():
    from shoal.engine.execution.layers.embedding import VocabParallelEmbedding
    from shoal.engine.execution.quantization.int8 import quantize_rows_int8

    torch.manual_seed(3)
    emb = VocabParallelEmbedding(50, 24, torch.bfloat16)
    emb.weight.data.copy_(torch.randn(50, 24))
    q, scale = quantize_rows_int8(emb.weight.data)
    emb.quantize_int8()
    emb.weight.data = torch.empty(0, dtype=torch.bfloat16)
    ids = torch.tensor([0, 7, 7, 49])
    torch.testing.assert_close(emb(ids), (q[ids].float() * scale[ids]).bfloat16())


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int4_kernel_equals_dense_matmul_with_its_dequantized_weight(m, k, n):
    torch.manual_seed(1)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    q = Int4Weight.from_dense(w)
    deq = q.dequantize()
    torch.testing.assert_close(q.matmul(x), x @ deq.t(), rtol=1e-4, atol=1e-4)
    # round-to-nearest on groups of at most 128: every weight within half a step of its group's range / 15
    assert (deq - w).abs().max() <= (w.max() - w.min()) / 30 + 1e-6
    assert q.packed.numel() * q.packed.element_size() == w.numel() // 2  # half a byte per weight
    assert q.nbytes() == w.numel() // 2 + (w.numel() // q.group) * 2 * 4  # + a float32 scale and zero per group


def _first_step_logprobs(model_dir, **kw):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=8, seed=0)
    with LLM(model=model_dir, **OPTIONS, **kw) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def _logprob_error(ref, got) -> tuple[float, float]:
    """(mean, max) |logprob difference| over the tokens both runs list at the first step."""
    diffs = []
    for a, b in zip(ref, got):
        ea, eb = a.logprobs[0], b.logprobs[0]
        diffs += [abs(ea[t].logprob - eb[t].logprob) for t in set(ea) & set(eb)]
    return sum(diffs) / len(diffs), max(diffs)


# Measured on this seeded workload (random weights of std 0.15 give logits of large scale, the hard case):
# int8 mean 0.14 / max 0.57 nats and 7 of 8 first tokens equal; int4 mean 0.55 / max 1.96 and only 2 of 8 (4-bit
# round-to-nearest on Gaussian weights; int4's exactness is proven against dequantized weights below). A wrong
# scale or packing costs several nats.
@pytest.mark.parametrize("method,mean_bound,max_bound,min_agree", [("int8", 0.25, 1.0, 6), ("int4", 1.0, 3.0, 0)])
def test_logprob_error_against_the_unquantized_model_is_bounded(model_factory, method, mean_bound, max_bound,
                                                                 min_agree, caplog):
    model = model_factory("llama", hidden_size=192, intermediate_size=256)
    caplog.set_level("INFO", logger="shoal.engine.execution.quantization")
    ref = _first_step_logprobs(model)
    got = _first_step_logprobs(model, quantization=method)
    mean, worst = _logprob_error(ref, got)
    assert mean < mean_bound and worst < max_bound, (mean, worst)
    agree = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(ref, got))
    assert agree >= min_agree, agree
    assert f"to {method} (" in caplog.text and "MiB ->" in caplog.text  # says which kernel, and the memory


# Gemma 2/3 and Phi-3 (fused qkv / gate_up, GeGLU, soft-caps, sliding windows) under int8 weights and an fp8 KV
# cache, float32. Measured here: int8 mean 0.16-0.19 nats (Gemma), higher for Phi-3 at hidden 192, fp8 KV mean
# 0.02-0.26; a wrong scale, packing or a quantized copy that misses a fused tensor costs several nats.
# gpt-oss: int8 experts with their biases and clamped activation, sinks read over an fp8 cache.
@pytest.mark.parametrize("arch,overrides", [("gemma2", {}), ("gemma3", {}),
                                            ("phi3", dict(hidden_size=192, num_attention_heads=12)),
                                            ("gpt_oss", {})])
def test_int8_and_fp8_kv_on_the_2026_families(model_factory, arch, overrides):
    model = model_factory(arch, **overrides)
    ref = _first_step_logprobs(model)
    for kw, mean_bound, max_bound in ((dict(quantization="int8"), 0.5, 1.5), (dict(kv_cache_dtype="fp8"), 0.35, 1.0)):
        got = _first_step_logprobs(model, **kw)
        mean, worst = _logprob_error(ref, got)
        assert mean < mean_bound and worst < max_bound, (kw, mean, worst)
        assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(ref, got)) >= 4, kw  # of 8; broken: ~0


def test_int4_engine_equals_a_dense_model_holding_the_dequantized_weights(model_factory):
    model = model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    with LLM(model=model, quantization="int4", **OPTIONS) as q:
        got = q.generate(PROMPTS, params)
        deq = {name: m.format.dequantize() for name, m in q.llm_engine.executor.runner.model.named_modules()
               if isinstance(m, PackedMatmul) and isinstance(m.format, QuantizedWeight)}
    assert len(deq) == 4 * 3  # qkv, o, gate_up, down in each of the 3 layers; the LM head stays dense
    with LLM(model=model, **OPTIONS) as dense:
        modules = dict(dense.llm_engine.executor.runner.model.named_modules())
        for name, w in deq.items():
            modules[name].weight.data = w.contiguous()  # the layout the format chosen at load runs on
        ref = dense.generate(PROMPTS, params)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in ea:
                assert eb[t].logprob == pytest.approx(ea[t].logprob, abs=2e-4)


def test_quantized_gguf_model(model_factory, tmp_path):
    from gguf_fixtures import write_gguf

    path = write_gguf(model_factory("llama"), tmp_path / "tiny.gguf", weight_type="F16")
    ref = _first_step_logprobs(str(path))
    mean, _ = _logprob_error(ref, _first_step_logprobs(str(path), quantization="int8"))
    assert mean < 0.25


def test_fp8_is_refused_on_cpu_with_a_reason(model_factory):
    with pytest.raises(QuantizationError, match="fp8 weights need a CUDA GPU"):
        LLM(model=model_factory("llama"), quantization="fp8", device="cpu")
    with pytest.raises(QuantizationError, match="unknown quantization"):
        check_supported("int3", torch.device("cpu"))
    assert set(METHODS) == {"int8", "int4", "fp8"}


def test_cli_flag_reaches_the_engine_config():
    from shoal.engine import cli

    args = cli.build_parser().parse_args(["serve", "--model", "/m", "--quantization", "int4"])
    assert cli.engine_config_from_args(args).quantization == "int4"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--model", "/m", "--quantization", "int3"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_gpu_quantized_matmul(method):
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    w, x = torch.randn(512, 256, device="cuda") * 0.05, torch.randn(8, 256, device="cuda")
    q = METHODS[method].from_dense(w.bfloat16())
    y = q.matmul(x.bfloat16()).float()
    ref = x @ w.t()
    assert (y - ref).norm() / ref.norm() < 0.1
