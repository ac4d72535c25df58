"""Triton and FlashAttention backends against a dense reference, over paged caches with shuffled block tables.

The Triton kernel runs under Triton's interpreter on CPU. Triton reads TRITON_INTERPRET when functions are wrapped
by `triton.jit`, its own library functions included, which happens at the first `import triton`; so this module
sets TRITON_INTERPRET=1 on import when no GPU is present and triton is not imported yet. When something imported
triton earlier in the session (transformers' model classes do), the interpreter tests skip here and
test_triton_interpreter_subprocess runs them in a fresh interpreter instead. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shoal.engine.execution.attention.base import AttentionMetadata, write_kv
from shoal.engine.execution.attention.flash_attn import ALIBI_REFUSAL, FlashAttentionBackend
from shoal.engine.execution.attention.triton_attn import TritonAttentionBackend

pytestmark = pytest.mark.numerics

triton = pytest.importorskip("triton")

CPU = torch.device("cpu")
INTERPRETED = TritonAttentionBackend.is_available(CPU)[0]


@pytest.fixture
def interpret():
    if not INTERPRETED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1; run by test_triton_interpreter_subprocess")


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
              device="cpu", seed=0, spare_blocks=3):
    """A flat batch over a paged cache whose blocks are handed out in shuffled order.

    Returns (q, k_cache, v_cache, meta, dense keys per sequence, dense values per sequence). Unused cache slots
    hold NaN, so reading anything outside a sequence's context poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)  # one padding column of 0s
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    ks, vs, ctx_slots, new_slots, ctx_k, ctx_v, new_k, new_v = [], [], [], [], [], [], [], []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        blocks = [perm.pop() for _ in range(nblk[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(sl, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(sl, num_kv_heads, head_dim, generator=gen).to(dtype)
        ks.append(k)
        vs.append(v)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(sl)]
        ctx_slots += slots[: sl - ql]
        new_slots += slots[sl - ql:]
        ctx_k.append(k[: sl - ql])
        ctx_v.append(v[: sl - ql])
        new_k.append(k[sl - ql:])
        new_v.append(v[sl - ql:])
    # Cached context first (earlier steps), then this step's tokens through meta.slot_mapping, as the engine does.
    write_kv(torch.cat(ctx_k), torch.cat(ctx_v), k_cache, v_cache, torch.tensor(ctx_slots, dtype=torch.int64))
    slot_mapping = torch.tensor(new_slots, dtype=torch.int64)
    write_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, slot_mapping)

    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        is_decode_only=all(ql == 1 for ql in query_lens),
    )
    return q.to(device), k_cache.to(device), v_cache.to(device), meta, ks, vs


def hf_bloom_alibi(num_heads: int, length: int) -> torch.Tensor:
    """[num_heads, length]: the bias transformers' BLOOM adds to every query's scores, slope[h] * key_pos."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return build_alibi_tensor(torch.ones(1, length, dtype=torch.long), num_heads, torch.float32)[:, 0, :]


def reference(q, ks, vs, query_lens, scale, alibi=False):
    """Per-sequence dense causal attention in float64; GQA by repeating kv heads; ALiBi exactly as HF BLOOM
    adds it (slope * key_pos: the same as slope * (key_pos - query_pos) under softmax)."""
    num_heads = q.shape[1]
    out, start = [], 0
    for k, v, ql in zip(ks, vs, query_lens):
        sl = k.shape[0]
        group = num_heads // k.shape[1]
        qi = q[start: start + ql].double()
        kd = k.double().repeat_interleave(group, dim=1)
        vd = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, kd) * scale
        if alibi:
            scores = scores + hf_bloom_alibi(num_heads, sl).double()[:, None, :]
        q_pos = torch.arange(sl - ql, sl)
        scores = scores.masked_fill(torch.arange(sl)[None, :] > q_pos[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd))
        start += ql
    return torch.cat(out)


def run_triton(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
               alibi=False, num_splits=None, seed=0, device="cpu", tiles=None):
    q, k_cache, v_cache, meta, ks, vs = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                  block_size, dtype, device=device, seed=seed)
    scale = head_dim ** -0.5
    slopes = hf_bloom_alibi(num_heads, 2)[:, 1].to(device) if alibi else None
    out = TritonAttentionBackend(num_splits=num_splits, tiles=tiles).forward(q, k_cache, v_cache, meta, scale, slopes)
    ref = reference(q.cpu(), ks, vs, query_lens, scale, alibi)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    return out.cpu().double(), ref


def assert_close(out, ref, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------- triton, in the interpreter


def test_triton_availability_on_cpu():
    assert TritonAttentionBackend.supports_alibi and TritonAttentionBackend.name == "triton"
    assert TritonAttentionBackend.check_config(head_dim=20, dtype=torch.bfloat16, block_size=4, uses_alibi=True)[0]
    ok, reason = TritonAttentionBackend.is_available(CPU)
    if INTERPRETED:
        assert (ok, reason) == (True, "")
    else:
        assert not ok and "TRITON_INTERPRET=1" in reason


def test_triton_interpreter_subprocess():
    """The interpreter tests, in a fresh process with TRITON_INTERPRET=1 (when this one could not run them)."""
    if INTERPRETED:
        pytest.skip("the interpreter tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-m", "not gpu", "-p", "no:cacheprovider",
           "-k", "triton and not subprocess"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_prefill(interpret, block_size):
    ql = [5, 17, 1, 33]
    out, ref = run_triton(ql, ql, 4, 2, 16, block_size)
    assert_close(out, ref, torch.float32)


def test_triton_chunked_prefill(interpret):
    # 13, 21 and 0 tokens of cached context before this step's chunks.
    out, ref = run_triton([7, 16, 9], [20, 37, 9], 6, 2, 20, 16)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_decode(interpret, block_size):
    sl = [1, 15, 40, 33, 16]
    out, ref = run_triton([1] * len(sl), sl, 4, 2, 18, block_size)
    assert_close(out, ref, torch.float32)


def test_triton_mixed_batch_non_contiguous_q(interpret):
    ql, sl = [12, 1, 5, 1, 3], [12, 29, 21, 7, 40]
    q, k_cache, v_cache, meta, ks, vs = make_case(ql, sl, 6, 2, 20, 4, seed=1)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # q as a strided view, like a fused QKV projection's split
    out = TritonAttentionBackend().forward(qkv[:, :6], k_cache, v_cache, meta, 0.3)
    assert_close(out.double(), reference(q, ks, vs, ql, 0.3), torch.float32)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_triton_alibi_matches_hf_bloom(interpret, heads):
    ql, sl = [9, 1, 6], [9, 26, 38]
    out, ref = run_triton(ql, sl, heads[0], heads[1], 16, 4, alibi=True)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(interpret, dtype):
    ql, sl = [10, 1, 4], [10, 35, 19]
    out, ref = run_triton(ql, sl, 4, 2, 16, 16, dtype=dtype, alibi=dtype == torch.float16)
    assert_close(out, ref, dtype)


def test_triton_split_kv(interpret):
    # Flash-decoding path: keys split across programs, partial softmaxes combined on the host (some splits empty).
    sl = [1, 40, 23]
    out, ref = run_triton([1, 1, 1], sl, 4, 2, 16, 4, num_splits=3, alibi=True)
    assert_close(out, ref, torch.float32)
    out, ref = run_triton([6, 20], [30, 20], 4, 2, 16, 16, num_splits=2)
    assert_close(out, ref, torch.float32)


def test_triton_gpu_tile_sizes(interpret):
    # The tiles CUDA uses for prefill (64 x 64) and decode (16 x 64), run through the interpreter.
    ql, sl = [40, 1, 3], [40, 37, 30]
    out, ref = run_triton(ql, sl, 6, 2, 20, 16, tiles=(64, 64), alibi=True)
    assert_close(out, ref, torch.float32)
    out, ref = run_triton([1, 1], [37, 5], 4, 2, 16, 4, tiles=(16, 64))
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("seed", range(4))
def test_triton_random_batches(interpret, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    seq_lens = [rnd(1, 40) for _ in range(rnd(1, 5))]
    query_lens = [rnd(1, s) if rnd(0, 2) else 1 for s in seq_lens]
    num_kv_heads, group = [(1, 4), (2, 1), (2, 3), (1, 2)][seed]
    head_dim = [16, 18, 20, 8][seed]
    out, ref = run_triton(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, [4, 16, 1, 8][seed],
                          alibi=bool(seed % 2), seed=seed)
    assert_close(out, ref, torch.float32)


# ---------------------------------------------------------------- flash


def test_flash_unavailable_here_with_reason():
    ok, reason = FlashAttentionBackend.is_available(torch.device("cpu"))
    assert not ok and "CUDA" in reason
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        ok, reason = FlashAttentionBackend.is_available(torch.device("cuda"))
        assert not ok and "flash_attn is not installed" in reason


def test_flash_refuses_alibi_with_clear_message():
    assert FlashAttentionBackend.name == "flash" and not FlashAttentionBackend.supports_alibi
    ok, reason = FlashAttentionBackend.check_config(head_dim=64, dtype=torch.float16, block_size=16, uses_alibi=True)
    assert not ok and reason == ALIBI_REFUSAL
    assert "ALiBi" in reason and "--attention-backend triton" in reason and "sdpa" in reason
    with pytest.raises(ValueError, match="ALiBi"):
        q, k_cache, v_cache, meta, _, _ = make_case([2], [2], 2, 2, 8, 4)
        FlashAttentionBackend().forward(q, k_cache, v_cache, meta, 1.0, torch.ones(2))


def test_flash_config_constraints():
    check = FlashAttentionBackend.check_config
    assert check(head_dim=128, dtype=torch.bfloat16, block_size=16) == (True, "")
    ok, reason = check(head_dim=64, dtype=torch.float32, block_size=16)
    assert not ok and "float16" in reason
    assert not check(head_dim=20, dtype=torch.float16, block_size=16)[0]
    q, k_cache, v_cache, meta, _, _ = make_case([2], [2], 2, 2, 8, 4)
    with pytest.raises(ValueError, match="float16 and bfloat16 only"):
        FlashAttentionBackend().forward(q, k_cache, v_cache, meta, 1.0)
    assert FlashAttentionBackend.reads_cache_in_place(256) and not FlashAttentionBackend.reads_cache_in_place(16)


def test_flash_context_slots_follow_block_tables():
    _, k_cache, _, meta, ks, _ = make_case([3, 1], [7, 10], 2, 2, 8, 4)
    slots = FlashAttentionBackend._context_slots(meta, 4, torch.device("cpu"))
    gathered = k_cache.view(-1, 2, 8)[slots]
    torch.testing.assert_close(gathered, torch.cat(ks))


# ---------------------------------------------------------------- real GPU (skipped without CUDA)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alibi", [False, True])
def test_triton_compiled_on_cuda(dtype, alibi):
    if INTERPRETED:
        pytest.skip("triton runs interpreted in this process")
    ql, sl = [100, 1, 37, 1, 1], [100, 300, 80, 1, 513]
    for splits in (None, 4):
        out, ref = run_triton(ql, sl, 8, 2, 80, 16, dtype=dtype, alibi=alibi, num_splits=splits, device="cuda")
        assert_close(out, ref, dtype)
    # A long decode batch, where the automatic split-KV heuristic kicks in.
    sl = [2000, 1500, 3]
    out, ref = run_triton([1] * 3, sl, 8, 2, 128, 16, dtype=dtype, alibi=alibi, device="cuda")
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_on_cuda(block_size):
    ok, reason = FlashAttentionBackend.is_available(torch.device("cuda"))
    if not ok:
        pytest.skip(reason)
    ql, sl = [100, 1, 37, 1], [100, 300, 80, 600]
    q, k_cache, v_cache, meta, ks, vs = make_case(ql, sl, 8, 2, 64, block_size, torch.float16, device="cuda")
    scale = 1 / math.sqrt(64)
    out = FlashAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    assert_close(out.cpu().double(), reference(q.cpu(), ks, vs, ql, scale), torch.float16)
