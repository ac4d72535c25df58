"""Attention sinks (gpt-oss: a learned logit per head in every softmax denominator) in every backend that runs on
CPU — the C++ kernel (streaming and its long-prefill SDPA path, bf16 and fp8 caches), SDPA, Triton under its
interpreter — against a dense float64 reference, with and without a sliding window; flash refuses them."""

from __future__ import annotations

import pytest
import torch

from test_cpu_paged_attention import TOL, make_case
from shoal.engine.execution.attention import backend_class, select_backend
from shoal.engine.execution.attention.base import dequantize_fp8, quantize_fp8
from shoal.engine.execution.attention.cpu_paged import CpuPagedAttentionBackend
from shoal.engine.execution.attention.sdpa import SdpaBackend

pytestmark = pytest.mark.numerics

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# Sinks from "attend to almost nothing" (large) to "no effect" (very negative), one per head.
SINKS = torch.tensor([3.0, -0.5, 0.7, -30.0])
CASES = {  # (query lens, context lens): decode, chunked prefill against cached context, long prefill chunks, mixed
    "decode": ([1, 1, 1], [13, 40, 7]),
    "chunked": ([9, 16], [30, 45]),
    "long-prefill": ([40, 33], [40, 90]),
    "mixed": ([1, 20, 1, 5], [50, 20, 9, 33]),
}


def reference(q, ks, vs, query_lens, scale, sinks, window=None):
    out, start = [], 0
    for k, v, ql in zip(ks, vs, query_lens):
        sl, group = k.shape[0], q.shape[1] // k.shape[1]
        kd, vd = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start: start + ql].double(), kd) * scale
        q_pos, k_pos = torch.arange(sl - ql, sl), torch.arange(sl)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, ql, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out.append(torch.einsum("hqk,khd->qhd", probs, vd))
        start += ql
    return torch.cat(out)


def run(backend, case, window=None, dtype=torch.float32, fp8=False):
    query_lens, seq_lens = CASES[case]
    q, k_cache, v_cache, meta, ks, vs = make_case(query_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, 4, dtype)
    k_cache.nan_to_num_(0.0)  # SDPA gathers whole blocks (and masks): no NaN may sit in unused slots
    v_cache.nan_to_num_(0.0)
    scales = {}
    if fp8:  # the reference sees what the fp8 cache holds
        (k_cache, ksc), (v_cache, vsc) = quantize_fp8(k_cache), quantize_fp8(v_cache)
        scales = dict(k_scale=ksc, v_scale=vsc)
        ks = [dequantize_fp8(*quantize_fp8(k), torch.float32) for k in ks]
        vs = [dequantize_fp8(*quantize_fp8(v), torch.float32) for v in vs]
    scale = HEAD_DIM ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale, sliding_window=window, sinks=SINKS, **scales)
    ref = reference(q, ks, vs, query_lens, scale, SINKS, window)
    tol = TOL[dtype] if not fp8 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The sinks matter: without them the output differs by far more than the tolerance.
    assert (ref - reference(q, ks, vs, query_lens, scale, torch.full((HEADS,), -1e9), window)).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_sinks(case, window):
    """Long prefill chunks go to the backend's SDPA path (explicit matmuls with the sink column), the rest to
    the kernel."""
    run(CpuPagedAttentionBackend(dense_prefill=True), case, window)


def test_cpu_kernel_sinks_long_prefill_in_the_kernel():
    run(CpuPagedAttentionBackend(dense_prefill=False), "long-prefill", 6)


@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_kernel_sinks_bfloat16(fp8):
    """bf16 queries (the AVX512-BF16 path where the CPU has it: full-context layers, head_dim % 32 == 0), and an
    fp8 cache read with them."""
    run(CpuPagedAttentionBackend(), "mixed", dtype=torch.bfloat16, fp8=fp8)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_sdpa_sinks(case, window):
    run(SdpaBackend(), case, window)


@pytest.mark.parametrize("splits,window", [(1, 6), (2, None)])
def test_triton_sinks(window, splits):
    """The sink enters the first key split only (split-KV decode: counted once when the splits combine)."""
    cls = backend_class("triton")
    ok, why = (False, "triton is not importable") if cls is None else cls.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    run(cls(num_splits=splits), "mixed" if splits == 1 else "decode", window)


def test_flash_refuses_sinks_and_auto_skips_it():
    with pytest.raises(ValueError, match="cannot add attention sinks.*triton"):
        select_backend("flash", torch.device("cpu"), uses_alibi=False, uses_sinks=True, head_dim=64,
                       dtype=torch.bfloat16, block_size=16)
    assert select_backend("auto", torch.device("cpu"), uses_alibi=False, uses_sinks=True).supports_sinks
