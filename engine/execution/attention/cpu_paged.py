"""CPU paged attention: a C++ kernel that reads keys/values straight from the paged cache through the block table.

The SDPA backend gathers every sequence's blocks into a dense copy per layer (k_cache[block_tables]) and then runs
SDPA over it; in decode, which is memory-bound, that copy dominates. This backend streams each sequence's blocks in
place with an online softmax in float32, handling the whole flat batch (decode, prefill, chunked prefill against
cached context), GQA (all query heads of a kv head share each block load), ALiBi, sliding windows (blocks before
a query tile's window are never read), attention-logit soft-capping and attention sinks, for float32/bfloat16/float16
caches and any head_dim up to 256; on CPUs with AVX512-BF16, bfloat16 dot products use vdpbf16ps. FP8 caches
(float8_e4m3fn with per-row scales, --kv-cache-dtype fp8) are decoded to float in the kernel, block by block. Long prefill
chunks (compute-bound, where a gather is cheap) go to torch's SDPA instead. See csrc/cpu_paged_attention.cpp.

The kernel is compiled on first use for this process's CPU tier (execution/native_build.py: the tier's ISA flags,
cached in torch's extensions directory keyed by the source and the tier; execution/cpu_features.py picks the tier).
If it cannot be built, is_available says why and `auto` falls back to SDPA.

`python -m shoal.engine.execution.attention.cpu_paged` benchmarks decode attention per layer against the SDPA backend,
over bf16 and fp8 caches.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from shoal.engine.execution.attention.base import (AttentionBackend, AttentionMetadata, FP8_DTYPE,
                                                  check_blocks_and_heads, dequantize_fp8, explicit_attention)

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A sequence whose query chunk this step has at least DENSE_MIN_QUERY_LEN tokens and DENSE_MIN_PAIRS
# (query, key) pairs goes to torch's SDPA over a gathered copy of its context instead of the kernel (crossover
# measured on an AVX-512 Xeon, bf16, head_dim 64, 1 thread; see _dense_sequence).
DENSE_MIN_QUERY_LEN = 16
DENSE_MIN_PAIRS = 4096


@functools.cache
def load_kernel() -> tuple[object | None, str, float]:
    """(torch.ops.shoal_cpu_paged.paged_attention or None, why not, seconds spent building/loading)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    start = time.perf_counter()
    try:
        op = kernel_ops("paged_attention").paged_attention
    except NativeBuildError as e:  # a missing compiler/ninja/header must never break the engine: fall back
        logger.warning("%s", e)
        return None, str(e), time.perf_counter() - start
    from shoal.engine.execution.attention import base

    base.fused_cpu_fp8_write = torch.ops.shoal_cpu_paged.write_fp8
    base.fused_cpu_kv_write = torch.ops.shoal_cpu_paged.write_kv
    return op, "", time.perf_counter() - start


@functools.cache
def amx_decode_ops():
    """torch.ops.shoal_cpu_amx_attn (csrc/cpu_amx_decode_attention.cpp: decode attention in AMX tile products, each
    kv head's query heads together) where this CPU tier has AMX tiles, else None. SHOAL_DISABLE_AMX_ATTENTION=1
    keeps every step on the streaming kernel (for comparisons)."""
    from shoal.engine.execution.cpu_features import cpu_features
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    if os.environ.get("SHOAL_DISABLE_AMX_ATTENTION") == "1" or cpu_features().tier != "amx":
        return None
    try:
        ops = kernel_ops("amx_decode_attention")
    except NativeBuildError as e:  # never fatal: the streaming kernel serves
        logger.warning("%s", e)
        return None
    return ops if ops.available() else None


# Query heads per kv head from which the AMX decode kernel beats the streaming kernel without a window (bf16, 25
# sequences of ~185 tokens, 2 threads, Intel Xeon with AMX, per layer: groups of 2-3 heads parity (0.98-1.04x), 4
# heads 1.04-1.07x, 8 heads 1.6-1.8x, 16 heads 1.8x). With a sliding window it wins from 1 head (1.4x): the
# streaming kernel's bf16 fast path has no window.
AMX_MIN_GROUP = 4


def takes_amx_decode(q, k_cache, meta: AttentionMetadata, alibi_slopes, k_scale, softcap, sinks, window) -> bool:
    """A step for the AMX decode kernel: decode only, bfloat16 queries and cache (not fp8), head_dim a multiple of
    32, no ALiBi, soft-capping or sinks, and a sliding window or a group of AMX_MIN_GROUP query heads per kv head."""
    return (meta.is_decode_only and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and k_scale is None and alibi_slopes is None and not softcap and sinks is None
            and q.shape[-1] % 32 == 0 and (window or q.shape[1] >= AMX_MIN_GROUP * k_cache.shape[2])
            and amx_decode_ops() is not None)


class CpuPagedAttentionBackend(AttentionBackend):
    name = "cpu"
    graph_capture_safe = True
    supports_alibi = True
    supports_fp8_kv = True
    supports_sinks = True

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if torch.device(device).type != "cpu":
            return False, "the cpu attention backend runs on CPU only"
        op, why, _ = load_kernel()
        return op is not None, why

    @classmethod
    def check_config(cls, *, head_dim: int, dtype: torch.dtype, block_size: int, uses_alibi: bool = False,
                     num_heads: int | None = None, num_kv_heads: int | None = None) -> tuple[bool, str]:
        if dtype not in DTYPES:
            return False, f"the cpu backend supports float32/bfloat16/float16, not {dtype}"
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            return False, f"the cpu backend supports head_dim up to {MAX_HEAD_DIM} (got {head_dim})"
        return check_blocks_and_heads(block_size, num_heads, num_kv_heads)

    def __init__(self, dense_prefill: bool = True):
        self.dense_prefill = dense_prefill  # False: the kernel does every sequence, long prefill chunks included

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, alibi_slopes=None, k_scale=None,
                v_scale=None, sliding_window=None, softcap=None, sinks=None):
        op, why, _ = load_kernel()
        if op is None:
            raise RuntimeError(why)
        in_dtype = q.dtype
        if q.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE:  # an fp8 cache is read with q's dtype
            q = q.to(k_cache.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()  # rows may be strided (a view of a fused QKV projection); head_dim may not
        out = torch.empty(q.shape, dtype=q.dtype)
        # Converted once per step and shared by every layer (while the metadata holds the same tensors).
        sources = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        cached = meta.scratch.get("cpu_ints")
        if cached is not None and all(a is b for a, b in zip(cached[0], sources)):
            ints = cached[1]
        else:
            ints = [t.to(torch.int32).contiguous() for t in sources]
            meta.scratch["cpu_ints"] = (sources, ints)
        if takes_amx_decode(q, k_cache, meta, alibi_slopes, k_scale, softcap, sinks, sliding_window):
            amx_decode_ops().gqa_decode(out, q, k_cache, v_cache, ints[0], ints[1], float(scale),
                                        int(sliding_window or 0))
            return out if out.dtype == in_dtype else out.to(in_dtype)
        slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
        dense = [] if meta.is_decode_only or not self.dense_prefill else [
            i for i, (n, s) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list))
            if n >= DENSE_MIN_QUERY_LEN and n * s >= DENSE_MIN_PAIRS]
        skip = None
        if dense:
            skip = torch.zeros(meta.num_seqs, dtype=torch.bool)
            skip[dense] = True
        # the kernel leaves `dense` sequences
        window, cap = int(sliding_window or 0), float(softcap or 0.0)
        op(out, q, k_cache, v_cache, *ints, slopes, float(scale), skip, k_scale, v_scale, window, cap, sinks)
        for i in dense:
            self._dense_sequence(i, out, q, k_cache, v_cache, meta, scale, slopes, k_scale, v_scale, window, cap,
                                 sinks)
        return out if out.dtype == in_dtype else out.to(in_dtype)

    @staticmethod
    def _dense_sequence(i, out, q, k_cache, v_cache, meta, scale, slopes, k_scale=None, v_scale=None, window=0,
                        softcap=0.0, sinks=None):
        """A long prefill chunk is compute-bound: there gathering its context is cheap next to the attention
        itself, and torch's SDPA (bf16 GEMM micro-kernels) beats the streaming kernel's float32 dot products.
        With a sliding window only the blocks from the first query's window on are gathered."""
        nb, bs, kvh, D = k_cache.shape
        H = q.shape[1]
        q_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        start = int(meta.query_start_loc[i])
        ctx = seq_len - q_len
        first = max(0, ctx - window + 1) // bs if window else 0  # blocks before it are outside every window
        k_lo = first * bs
        blocks = meta.block_tables[i, first: -(-seq_len // bs)].long()
        n = seq_len - k_lo
        k, v = k_cache[blocks].flatten(0, 1)[:n], v_cache[blocks].flatten(0, 1)[:n]
        if k_scale is not None:
            k = dequantize_fp8(k, k_scale[blocks].flatten(0, 1)[:n], q.dtype)
            v = dequantize_fp8(v, v_scale[blocks].flatten(0, 1)[:n], q.dtype)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kvh, n, D]
        qi = q[start: start + q_len].transpose(0, 1)[None]  # [1, H, q_len, D]: 4-D takes the flash kernel
        if ctx == 0 and slopes is None and not softcap and sinks is None and not (window and window < seq_len):
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=H != kvh)
        else:
            rel = torch.arange(k_lo, seq_len).view(1, -1) - torch.arange(ctx, seq_len).view(-1, 1)  # key - query
            visible = (rel <= 0) & (rel > -window) if window else rel <= 0
            if softcap or sinks is not None:
                o = explicit_attention(qi, k, v, visible, scale, softcap, sinks)
            else:
                if slopes is None:
                    mask = visible
                else:
                    mask = (slopes.view(H, 1, 1) * rel).masked_fill(~visible, float("-inf")).to(q.dtype)
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=H != kvh)
        out[start: start + q_len] = o[0].transpose(0, 1)


# ------------------------------------------------------------------------------------------------- benchmark


def _bench(num_seqs=32, ctx=(150, 400), num_heads=8, num_kv_heads=4, head_dim=64, block_size=16,
           dtype=torch.bfloat16, iters=50):
    from shoal.engine.execution.attention.base import quantize_fp8
    from shoal.engine.execution.attention.sdpa import SdpaBackend

    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(ctx[0], ctx[1] + 1, (num_seqs,), generator=gen).tolist()
    nblk = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(nblk) + 8, generator=gen)
    tables = torch.zeros(num_seqs, max(nblk), dtype=torch.int32)
    start = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[start:start + n]
        start += n
    k_cache = torch.randn(len(perm), block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    plain = (k_cache, v_cache, None, None)
    (k8, ks), (v8, vs) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    fp8 = (k8, v8, ks, vs)
    print(f"decode attention per layer: B={num_seqs} contexts {ctx[0]}-{ctx[1]} (mean {sum(seq_lens) / num_seqs:.0f})"
          f" H={num_heads} kvh={num_kv_heads} D={head_dim} {str(dtype).split('.')[-1]} block {block_size}")
    switch = torch.ops.shoal_cpu_paged.set_bf16_fast_path
    variants = [("sdpa", SdpaBackend(), True, plain), ("cpu", CpuPagedAttentionBackend(), True, plain)]
    if dtype == torch.bfloat16 and switch(True):
        variants.append(("cpu without AVX512-BF16", CpuPagedAttentionBackend(), False, plain))
    variants.append(("cpu fp8 KV", CpuPagedAttentionBackend(), True, fp8))
    if dtype == torch.bfloat16 and switch(True):
        variants.append(("cpu fp8 KV without AVX512-BF16", CpuPagedAttentionBackend(), False, fp8))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        line = []
        for label, backend, fast, (kc, vc, ksc, vsc) in variants:
            switch(fast)
            # One step's metadata shared by every layer, as in the engine (SDPA plans once per step).
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_query_len=1,
                max_seq_len=max(seq_lens), query_lens_list=[1] * num_seqs, seq_lens_list=seq_lens,
                is_decode_only=True)
            for _ in range(5):
                backend.forward(q, kc, vc, meta, head_dim ** -0.5, k_scale=ksc, v_scale=vsc)
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                backend.forward(q, kc, vc, meta, head_dim ** -0.5, k_scale=ksc, v_scale=vsc)
                times.append(time.perf_counter() - t)
            times.sort()
            line.append(f"{label} median {1e3 * times[len(times) // 2]:.3f} ms (min {1e3 * times[0]:.3f})")
        print(f"  {threads} thread(s): " + ";\n               ".join(line))
    switch(True)


if __name__ == "__main__":
    op, why, secs = load_kernel()
    if op is None:
        raise SystemExit(why)
    print(f"kernel ready in {secs:.1f} s (build on first use, then cached)")
    _bench()
