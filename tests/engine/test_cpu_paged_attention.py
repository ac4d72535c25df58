"""The C++ CPU paged-attention backend against a dense float64 reference, over paged caches with shuffled blocks.

The kernel is compiled on first use (seconds; cached afterwards). gcc and ninja are part of the machine image
here and in CI, so a failed build FAILS these tests rather than skipping them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shoal.engine.execution.attention.base import AttentionMetadata, write_kv
from shoal.engine.execution.attention.cpu_paged import CpuPagedAttentionBackend, load_kernel

pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """A flat batch over a paged cache whose blocks are handed out in shuffled order.

    Returns (q, k_cache, v_cache, meta, dense keys per sequence, dense values per sequence). Unused cache slots
    hold NaN, so reading anything outside a sequence's context poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)  # a padding column of 0s
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    ks, vs, slots = [], [], []
    for i, sl in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(nblk[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(torch.randn(sl, num_kv_heads, head_dim, generator=gen).to(dtype))
        vs.append(torch.randn(sl, num_kv_heads, head_dim, generator=gen).to(dtype))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(sl)]
    write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.tensor(slots))
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),  # unused: the cache is already written
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        is_decode_only=all(ql == 1 for ql in query_lens),
    )
    return q, k_cache, v_cache, meta, ks, vs


def reference(q, ks, vs, query_lens, scale, slopes=None, window=None, softcap=None):
    """Per-sequence dense causal attention in float64; query head h reads kv head h // group; ALiBi adds
    slope[h] * (key_pos - query_pos); a sliding window hides keys more than window - 1 positions back;
    soft-capping maps each scaled score s to softcap * tanh(s / softcap)."""
    num_heads = q.shape[1]
    out, start = [], 0
    for k, v, ql in zip(ks, vs, query_lens):
        sl = k.shape[0]
        group = num_heads // k.shape[1]
        kd = k.double().repeat_interleave(group, dim=1)
        vd = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start: start + ql].double(), kd) * scale
        q_pos, k_pos = torch.arange(sl - ql, sl), torch.arange(sl)
        if slopes is not None:
            scores = scores + slopes.double().view(-1, 1, 1) * (k_pos[None, :] - q_pos[:, None])
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = k_pos[None, :] > q_pos[:, None]
        if window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd))
        start += ql
    return torch.cat(out)


def alibi_slopes(num_heads):
    return torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)


TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def check(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
          alibi=False, seed=0, dense_prefill=False):
    """dense_prefill=False runs every sequence through the kernel; True lets long prefill chunks take SDPA."""
    q, k_cache, v_cache, meta, ks, vs = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                  block_size, dtype, seed)
    scale = head_dim ** -0.5
    slopes = alibi_slopes(num_heads) if alibi else None
    out = CpuPagedAttentionBackend(dense_prefill).forward(q, k_cache, v_cache, meta, scale, slopes)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    ref = reference(q, ks, vs, query_lens, scale, slopes)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out


def test_kernel_builds_and_backend_is_available():
    op, why, _ = load_kernel()
    assert op is not None, why  # must fail, not skip: the compiler is part of the machine image
    assert CpuPagedAttentionBackend.is_available(CPU) == (True, "")
    assert not CpuPagedAttentionBackend.is_available(torch.device("meta"))[0]
    assert CpuPagedAttentionBackend.name == "cpu" and CpuPagedAttentionBackend.supports_alibi
    assert CpuPagedAttentionBackend.check_config(head_dim=20, dtype=torch.bfloat16, block_size=4)[0]
    assert not CpuPagedAttentionBackend.check_config(head_dim=320, dtype=torch.float32, block_size=16)[0]
    assert not CpuPagedAttentionBackend.check_config(head_dim=64, dtype=torch.float64, block_size=16)[0]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_decode(block_size, head_dim):
    sl = [1, 15, 40, 33, 16, 130]
    check([1] * len(sl), sl, 8, 4, head_dim, block_size)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill(block_size, dense):
    # 100 tokens with group 2 spans several 32-token query tiles (and is long enough for the dense path).
    ql = [5, 17, 1, 33, 100]
    check(ql, ql, 4, 2, 64, block_size, dense_prefill=dense)


@pytest.mark.parametrize("dense", [False, True])
def test_chunked_prefill_with_context(dense):
    # 13, 21, 0 and 70 tokens of cached context before this step's chunks.
    check([7, 16, 9, 40], [20, 37, 9, 110], 6, 2, 20, 16, dense_prefill=dense)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch(block_size, dense):
    check([12, 1, 5, 1, 3, 1, 64], [12, 29, 21, 7, 40, 64, 80], 8, 4, 64, block_size, seed=1, dense_prefill=dense)


def test_only_long_prefill_chunks_take_the_dense_path(monkeypatch):
    calls = []
    dense = CpuPagedAttentionBackend._dense_sequence
    monkeypatch.setattr(CpuPagedAttentionBackend, "_dense_sequence",
                        staticmethod(lambda i, *a: calls.append(i) or dense(i, *a)))
    # 15 tokens: too short; 16 x 300 and 64 x 64 pairs: enough; 16 x 100: too few pairs; decodes never.
    check([15, 16, 1, 64, 16], [300, 300, 50, 64, 100], 8, 4, 32, 16, dense_prefill=True)
    assert calls == [1, 3]
    calls.clear()
    check([1, 1], [300, 200], 8, 4, 32, 16, dense_prefill=True)
    assert calls == []


def test_strided_q_like_a_fused_qkv_split():
    ql, sl = [12, 1, 5], [12, 29, 21]
    q, k_cache, v_cache, meta, ks, vs = make_case(ql, sl, 6, 2, 20, 4, seed=2)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)
    out = CpuPagedAttentionBackend().forward(qkv[:, :6], k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out.double(), reference(q, ks, vs, ql, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
def test_alibi(heads, dense):
    check([9, 1, 6, 1, 70], [9, 26, 38, 70, 90], heads[0], heads[1], 16, 4, alibi=True, dense_prefill=dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_half_precision(dtype, head_dim):
    ql, sl = [10, 1, 4, 1, 48], [10, 35, 19, 200, 150]
    for dense in (False, True):
        check(ql, sl, 8, 4, head_dim, 16, dtype=dtype, alibi=dtype == torch.float16, dense_prefill=dense)


def test_large_head_dim_and_group():
    check([3, 1, 20], [30, 17, 20], 16, 2, 256, 16, dtype=torch.bfloat16)


def test_thread_count_does_not_change_results():
    args = ([1] * 6 + [40], [50, 3, 77, 16, 9, 120, 60], 8, 4, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = check(*args)
        torch.set_num_threads(2)
        two = check(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output row is computed by one thread in a fixed order


def test_rejects_bad_shapes():
    q, k_cache, v_cache, meta, _, _ = make_case([1], [5], 4, 2, 16, 4)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        CpuPagedAttentionBackend().forward(q[:, :3], k_cache, v_cache, meta, 0.25)
    meta.seq_lens = torch.tensor([500], dtype=torch.int32)  # more tokens than the block table holds
    with pytest.raises(RuntimeError, match="do not fit"):
        CpuPagedAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)


def test_build_failure_is_reported_not_raised(tmp_path):
    """A kernel that does not compile makes is_available (False, the compiler's error); nothing raises."""
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return 0 }\n")
    code = (f"import dataclasses, torch, pathlib\nfrom shoal.engine.execution import native_build as nb\n"
            f"from shoal.engine.execution.attention import cpu_paged as cp\n"
            f"nb.KERNELS['paged_attention'] = dataclasses.replace(nb.KERNELS['paged_attention'], "
            f"source=pathlib.Path({str(bad)!r}))\n"
            f"print(cp.CpuPagedAttentionBackend.is_available(torch.device('cpu')))")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(False, 'the cpu attention kernel could not be built:" in proc.stdout
    assert "bad.cpp:1:" in proc.stdout and "error:" in proc.stdout


@pytest.fixture(params=["fast", "generic"])
def bf16_path(request):
    """Both bfloat16 paths: AVX512-BF16 dot products (when this CPU and build have them) and float conversion."""
    assert load_kernel()[0] is not None
    switch = torch.ops.shoal_cpu_paged.set_bf16_fast_path
    if request.param == "fast" and not switch(True):
        pytest.skip("this CPU/build has no AVX512-BF16 path (the generic case covers it)")
    switch(request.param == "fast")
    yield request.param
    switch(True)


@pytest.mark.parametrize("block_size", [4, 16, 5, 32, 37])
def test_bf16_paths(bf16_path, block_size):
    # Odd context lengths and odd block sizes leave odd key counts per block (the fast path pairs keys); blocks
    # above 16 keys take the fast path's 16-key chunks more than once, 37 with a short last chunk.
    ql, sl = [1, 1, 1, 7, 20, 1], [1, 2, 33, 7, 45, 301]
    for head_dim in (64, 96, 20):  # the fast path needs head_dim % 32 == 0
        check(ql, sl, 8, 4, head_dim, block_size, dtype=torch.bfloat16, alibi=head_dim == 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_kv_write_equals_index_copy(dtype):
    """write_kv's one-call C++ scatter (k/v as strided views of a fused QKV projection, as the models pass them)
    writes exactly what the two index_copy_ did, and refuses a slot outside the cache."""
    from shoal.engine.execution.attention import base

    load_kernel()
    assert base.fused_cpu_kv_write is not None
    T, H, D = 7, 2, 16
    qkv = torch.randn(T, 4 * D + 2 * H * D).to(dtype)
    k = qkv[:, 4 * D:4 * D + H * D].view(T, H, D)
    v = qkv[:, 4 * D + H * D:].view(T, H, D)
    slots = torch.randperm(40)[:T]
    k_cache, v_cache = torch.zeros(10, 4, H, D, dtype=dtype), torch.zeros(10, 4, H, D, dtype=dtype)
    write_kv(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_ref.view(40, H, D).index_copy_(0, slots, k)
    v_ref.view(40, H, D).index_copy_(0, slots, v)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    heads_apart = torch.randn(T, H, 2 * D).to(dtype)[:, :, :D]  # rows whose heads are not adjacent
    write_kv(heads_apart, heads_apart, k_cache, v_cache, slots)
    k_ref.view(40, H, D).index_copy_(0, slots, heads_apart)
    assert torch.equal(k_cache, k_ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv(k, v, k_cache, v_cache, torch.full((T,), 40))
