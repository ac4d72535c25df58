"""Sliding-window attention and attention-logit soft-capping in every backend that runs on CPU (the C++ kernel,
SDPA, Triton under its interpreter) against a dense float64 reference.

Contexts are longer than the window, and the table entries of blocks that slid out of every query's window point
at a poisoned block, as the scheduler's freeing does (it leaves block 0 there): NaN for the kernels that must
never read such blocks (C++, Triton), huge finite values for SDPA, which gathers whole tables and masks them out.
"""

from __future__ import annotations

import pytest
import torch

from test_cpu_paged_attention import TOL, make_case, reference
from shoal.engine.execution.attention import backend_class
from shoal.engine.execution.attention.cpu_paged import CpuPagedAttentionBackend
from shoal.engine.execution.attention.sdpa import SdpaBackend

pytestmark = pytest.mark.numerics


def slide_out(k_cache, v_cache, meta, window: int, poison: float) -> int:
    """Point every table entry of a block wholly before its sequence's first query's window at a spare block
    filled with `poison`; returns how many entries were redirected."""
    bs = k_cache.shape[1]
    used = set(meta.block_tables.flatten().tolist())
    spare = next(b for b in range(k_cache.shape[0]) if b not in used)
    k_cache[spare] = poison
    v_cache[spare] = poison
    moved = 0
    for i, (ql, sl) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        gone = max(0, sl - ql - window + 1) // bs  # blocks no query of this step can see
        meta.block_tables[i, :gone] = spare
        moved += gone
    return moved


def run(backend, query_lens, seq_lens, window, softcap=None, block_size=4, heads=(4, 2), head_dim=16, seed=0,
        poison=float("nan")):
    q, k_cache, v_cache, meta, ks, vs = make_case(query_lens, seq_lens, *heads, head_dim, block_size, seed=seed)
    if poison == poison:  # a finite poison: SDPA gathers (and masks) whole blocks, so no NaN may sit anywhere
        k_cache.nan_to_num_(0.0)
        v_cache.nan_to_num_(0.0)
    moved = slide_out(k_cache, v_cache, meta, window, poison)
    if any(sl - ql >= window + block_size for ql, sl in zip(query_lens, seq_lens)):
        assert moved > 0, "the case must free some blocks"
    scale = head_dim ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale, sliding_window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    ref = reference(q, ks, vs, query_lens, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


# prefill longer than the window, chunked prefill against cached context, decode, and all in one batch
CASES = {
    "prefill": ([37], [37]),
    "chunked": ([9, 16], [30, 45]),
    "decode": ([1, 1, 1], [13, 40, 7]),
    "mixed": ([1, 20, 1, 5], [50, 20, 9, 33]),
}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dense", [False, True])
def test_cpu_kernel_window(case, softcap, dense):
    window = 6
    run(CpuPagedAttentionBackend(dense_prefill=dense), *CASES[case], window, softcap)


def test_cpu_kernel_long_chunks_take_dense_path_with_window():
    # 40-token chunks are long enough for the SDPA path; windows smaller and larger than a block.
    for window in (3, 11):
        run(CpuPagedAttentionBackend(dense_prefill=True), [40, 40], [40, 120], window, softcap=3.0, block_size=8)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_window(case, softcap):
    run(SdpaBackend(), *CASES[case], 6, softcap, poison=1e4)


def test_window_wider_than_context_is_plain_causal():
    q, k_cache, v_cache, meta, ks, vs = make_case([5, 1], [5, 9], 4, 2, 16, 4)
    k_cache.nan_to_num_(0.0)
    v_cache.nan_to_num_(0.0)
    for backend in (CpuPagedAttentionBackend(), SdpaBackend()):
        out = backend.forward(q, k_cache, v_cache, meta, 0.25, sliding_window=64)
        torch.testing.assert_close(out.double(), reference(q, ks, vs, [5, 1], 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("case", ["chunked", "mixed"])
def test_triton_window(case, softcap):
    cls = backend_class("triton")
    ok, why = (False, "triton is not importable") if cls is None else cls.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    run(cls(), *CASES[case], 6, softcap)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend_name", ["flash", "triton"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_backends_window(backend_name, softcap):
    """flash (window_size / softcap arguments) and compiled Triton, half precision, windows past many blocks."""
    cls = backend_class(backend_name)
    ok, why = (False, "not importable") if cls is None else cls.is_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    ql, sl = [100, 1, 37, 1], [100, 300, 80, 600]
    q, k_cache, v_cache, meta, ks, vs = make_case(ql, sl, 8, 2, 64, 16, torch.float16)
    k_cache.nan_to_num_(0.0)
    v_cache.nan_to_num_(0.0)
    meta.scratch.clear()
    to = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, f, to(getattr(meta, f)))
    out = cls().forward(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta, 0.125, sliding_window=50, softcap=softcap)
    ref = reference(q, ks, vs, ql, 0.125, window=50, softcap=softcap)
    torch.testing.assert_close(out.cpu().double(), ref, atol=3e-3, rtol=3e-3)
