"""Triton paged attention: one kernel launch for the whole flat batch (prefill chunks and decodes alike).

Keys and values are read straight from the paged cache through the block table (no gather into a contiguous
copy); softmax is computed online (FlashAttention style) in float32, whatever the cache dtype. Handles causal
prefill, chunked prefill against cached context, decode, grouped-query attention, BLOOM-style ALiBi, sliding
windows (keys before a query tile's window are never loaded), attention-logit soft-capping, attention sinks
(each row's online softmax starts from its head's sink logit, in the first key split only) and any head_dim (padded
to a power of two with masks). An fp8 cache (float8_e4m3fn, --kv-cache-dtype fp8) is loaded as bytes
and decoded with integer ops (_e4m3_to_float: exact, and the same on every GPU generation — Triton's own
fp8e4nv conversions need compute capability 8.9 on some versions — and in the interpreter); its per-(slot, kv
head) scales fold into the scores (s_j * ks_j) and into the probabilities that weight the values (p_j * vs_j), so
no dequantized copy of a tile is formed.

Runs compiled on CUDA, and on CPU under Triton's interpreter, which is how the tests run it. Triton decides
interpreted-or-compiled when a function is wrapped by `triton.jit`, and its own library functions (tl.max, tl.sum,
...) are wrapped when `triton` is first imported: TRITON_INTERPRET=1 must therefore be in the environment before
the first `import triton` of the process (transformers' model classes import triton, so set it early).
"""

import torch

from shoal.engine.execution.attention.base import AttentionBackend, AttentionMetadata, check_blocks_and_heads

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton (sdpa); this backend then reports itself unavailable
    triton = None
    tl = None

_LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _e4m3_to_float(x):
        """float8_e4m3fn codes (uint8) -> float32, exactly: normals by rebiasing the exponent bits (7 -> 127),
        subnormals (exponent 0) as mantissa * 2^-9. NaN codes decode to +-480 (the cache never holds them)."""
        x = x.to(tl.int32)
        mag = x & 0x7F
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        value = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)
        return tl.where((x & 0x80) != 0, -value, value)

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        k_scale_ptr, v_scale_ptr,  # fp8 caches: [num_blocks, block_size, kv_heads] float32 (FP8_KV only)
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, alibi_slopes_ptr,
        sinks_ptr,  # [num_heads] float32 sink logits (SINKS only)
        part_acc_ptr, part_m_ptr, part_l_ptr,
        scale_log2,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper than exp)
        window,  # sliding window: a query at position p sees keys p - window + 1 .. p (0: every key)
        softcap,  # attention-logit soft-cap (SOFTCAP only): scaled score s -> softcap * tanh(s / softcap)
        num_seqs,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_ksb, stride_kss, stride_ksh,
        stride_vsb, stride_vss, stride_vsh,
        stride_ps, stride_pt, stride_ph,  # partial results [NUM_SPLITS, T, H, (HEAD_DIM)] (split-KV only)
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        USE_ALIBI: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,  # dots in float32 (for the interpreter, whose bfloat16 dot is broken)
        FP8_KV: tl.constexpr,
        SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        """Causal attention of a tile of query tokens against the paged context of their sequence.

        Grid: (query tiles, kv heads, key splits).
          axis 0: query tile. Sequence s owns tiles [qsl[s] // BLOCK_Q + s, ...), one per BLOCK_Q of its query
                  tokens (the "+ s" leaves room for every sequence's partial last tile), so the grid is
                  T // BLOCK_Q + num_seqs and a program finds its sequence by binary search over
                  query_start_loc; programs past the end of their sequence's query exit at once.
          axis 1: kv head. The program handles the GROUP query heads that share it, so each key/value tile it
                  loads serves BLOCK_M = BLOCK_Q * GROUP_P rows (token-major, head-minor; rows for padded
                  heads g >= GROUP are masked). For decode this packs a whole GQA group into one tile.
          axis 2: key split (flash-decoding). With NUM_SPLITS > 1 each split covers a contiguous share of the key
                  tiles and writes un-normalised partial results (acc, running max, running sum) that the host
                  combines; with NUM_SPLITS == 1 the program writes the final output.
        Tiling: q tile [BLOCK_M, HEAD_DIM_P] stays in registers; keys/values stream in tiles of BLOCK_N positions,
        each position's cache slot looked up through the block table; scores [BLOCK_M, BLOCK_N] in float32.
        """
        q_tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        # Which sequence owns this query tile: the last s with query_start_loc[s] // BLOCK_Q + s <= q_tile.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_tile:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1

        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile_local = q_tile - (q_start // BLOCK_Q + seq)
        if q_tile_local * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens cached before this step's queries

        rows = tl.arange(0, BLOCK_M)
        tok = q_tile_local * BLOCK_Q + rows // GROUP_P  # query token index within the sequence
        grp = rows % GROUP_P
        head = kv_head * GROUP + grp
        row_ok = (tok < q_len) & (grp < GROUP)
        q_pos = context_len + tok  # absolute position: attends to keys 0..q_pos
        dims = tl.arange(0, HEAD_DIM_P)
        dim_ok = dims < HEAD_DIM

        q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if USE_ALIBI:
            slope_log2 = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634

        # Keys this tile can see (causal: up to its last token), and this split's share of them.
        kv_end = tl.minimum(seq_len, context_len + (q_tile_local + 1) * BLOCK_Q)
        num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
        # With a window, keys before the tile's first query's window are never read (their blocks may be freed).
        k_lo = tl.where(window > 0, tl.maximum(context_len + q_tile_local * BLOCK_Q - window + 1, 0), 0)
        first_tile = k_lo // BLOCK_N
        tiles_per_split = tl.cdiv(num_kv_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if SINKS:  # the sink as a key of value zero seen first: max = sink, sum = 1 (split 0 only: counted once)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
        block_row = block_tables_ptr + seq * stride_bt
        for kv_tile in range(tile_lo, tile_hi):
            k_pos = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            k_ok = (k_pos < kv_end) & (k_pos >= k_lo)
            block = tl.load(block_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
            slot = k_pos % PAGE_SIZE

            k_offs = block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh \
                + dims[:, None] * stride_kd
            if FP8_KV:
                k = _e4m3_to_float(tl.load(k_cache_ptr + k_offs, mask=k_ok[None, :] & dim_ok[:, None], other=0))
                k = k.to(q.dtype)  # exact: e4m3 fits in float16 and bfloat16
            else:
                k = tl.load(k_cache_ptr + k_offs, mask=k_ok[None, :] & dim_ok[:, None], other=0.0).to(q.dtype)  # [D, N]
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N] float32
            if SOFTCAP:  # in natural units: softcap * tanh(x / softcap), tanh(y) = 2 / (1 + e^(-2y)) - 1
                y = s * (1.0 / (1.4426950408889634 * softcap))
                s = (2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0) * (softcap * 1.4426950408889634)
            if FP8_KV:
                k_sc = tl.load(k_scale_ptr + block * stride_ksb + slot * stride_kss + kv_head * stride_ksh,
                               mask=k_ok, other=0.0)
                s = s * k_sc[None, :]
            if USE_ALIBI:
                s += slope_log2[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] \
                & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)

            v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh \
                + dims[None, :] * stride_vd
            if FP8_KV:
                v = _e4m3_to_float(tl.load(v_cache_ptr + v_offs, mask=k_ok[:, None] & dim_ok[None, :], other=0))
                v = v.to(q.dtype)
            else:
                v = tl.load(v_cache_ptr + v_offs, mask=k_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)  # [N, D]
            if FP8_KV:  # the values' scales weigh the probabilities; l_i above sums the unscaled ones
                v_sc = tl.load(v_scale_ptr + block * stride_vsb + slot * stride_vss + kv_head * stride_vsh,
                               mask=k_ok, other=0.0)
                pv = p * v_sc[None, :]
            else:
                pv = p
            acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            p_offs = split * stride_ps + (q_start + tok) * stride_pt + head * stride_ph
            tl.store(part_m_ptr + p_offs, m_i, mask=row_ok)
            tl.store(part_l_ptr + p_offs, l_i, mask=row_ok)
            tl.store(part_acc_ptr + p_offs[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=row_ok[:, None] & dim_ok[None, :])


def _interpreting() -> bool:
    """True when this process runs Triton through its interpreter: both triton's library and this kernel were
    wrapped with TRITON_INTERPRET=1 set (it is read at `triton.jit` time, not at launch)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction) and isinstance(_paged_attention_kernel, InterpretedFunction)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_device_props: dict[int, tuple[int, int]] = {}


def _cuda_props(device: torch.device) -> tuple[int, int]:
    """(SM count, compute capability major) of a CUDA device, cached."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _device_props:
        props = torch.cuda.get_device_properties(idx)
        _device_props[idx] = (props.multi_processor_count, props.major)
    return _device_props[idx]


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in one Triton launch per layer call; supports ALiBi, GQA, any head_dim, fp32/fp16/bf16.

    `num_splits` forces the split-KV (flash-decoding) factor; None picks it from the batch shape on CUDA
    (only for decode-only batches that would leave most SMs idle) and 1 under the interpreter.
    `tiles` forces (BLOCK_M, BLOCK_N) (powers of two >= 16), for tuning and tests; None picks them.
    """

    name = "triton"
    graph_capture_safe = True
    supports_alibi = True
    supports_fp8_kv = True
    supports_sinks = True

    def __init__(self, num_splits: int | None = None, tiles: tuple[int, int] | None = None):
        self.num_splits = num_splits
        self.tiles = tiles

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if triton is None:
            return False, "triton is not installed (pip install triton)"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "CUDA is not available"
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (7, 5):
                return False, f"the triton backend needs a GPU of compute capability >= 7.5 (got {major}.{minor})"
            return True, ""
        if device.type == "cpu":
            if _interpreting():
                return True, ""
            return False, ("the triton backend runs on CPU only under Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported (slow; meant for tests)")
        return False, f"the triton backend does not run on {device.type} devices"

    @classmethod
    def check_config(cls, *, head_dim: int, dtype: torch.dtype, block_size: int, uses_alibi: bool = False,
                     num_heads: int | None = None, num_kv_heads: int | None = None) -> tuple[bool, str]:
        """(usable, reason when not) for a model/cache configuration, independent of the device."""
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"the triton backend supports float32/float16/bfloat16, not {dtype}"
        if not 1 <= head_dim <= 256:
            return False, f"the triton backend supports head_dim up to 256 (got {head_dim})"
        return check_blocks_and_heads(block_size, num_heads, num_kv_heads)

    def _pick_num_splits(self, device: torch.device, meta: AttentionMetadata, programs: int, block_n: int) -> int:
        if self.num_splits is not None:
            return max(1, int(self.num_splits))
        if device.type != "cuda" or meta.max_query_len > 1:
            return 1
        # Decode: split the keys when (sequences x kv heads) alone would leave SMs idle and contexts are long
        # (at least two key tiles per split for the longest sequence). Powers of two bound recompilations.
        target = 2 * _cuda_props(device)[0]
        tiles = meta.max_seq_len // (2 * block_n)
        if programs >= target or tiles < 2:
            return 1
        return min(_next_pow2(-(-target // programs)), 16, 1 << (tiles.bit_length() - 1))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        alibi_slopes: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if num_tokens == 0:
            return out
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        num_seqs = meta.query_start_loc.shape[0] - 1
        group = num_heads // num_kv_heads
        group_p = _next_pow2(group)
        head_dim_p = max(16, _next_pow2(head_dim))

        interpreting = _interpreting() and q.device.type == "cpu"
        if self.tiles is not None:
            block_m, block_n = max(self.tiles[0], group_p), self.tiles[1]
        elif interpreting:
            block_m, block_n = max(16, group_p), 16  # small tiles: cheap in numpy, and the tests cross tiles
        else:
            # Decode-like batches: 16 rows (a GQA group of one token, or a few tokens); prefill: 64 rows.
            # Wide tiles (head_dim > 128, float32, pre-Ampere GPUs) are halved to keep shared memory within
            # ~64 KB (sm_75) / ~100 KB (sm_86/89); float32 with head_dim 256 is quartered.
            decode_like = meta.max_query_len * group_p <= 16
            wide = head_dim_p > 128 or q.dtype == torch.float32 or _cuda_props(q.device)[1] < 8
            block_m = max(16 if decode_like else (32 if wide else 64), group_p)
            block_n = 32 if wide else 64
            if head_dim_p > 128 and q.dtype == torch.float32:
                block_m, block_n = max(16, group_p), 16
        block_q = block_m // group_p
        upcast = interpreting and q.dtype == torch.bfloat16

        grid0 = num_tokens // block_q + num_seqs
        splits = self._pick_num_splits(q.device, meta, num_seqs * num_kv_heads, block_n)

        if alibi_slopes is not None:
            alibi = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
        else:
            alibi = out  # never read (USE_ALIBI is False)
        if splits > 1:
            part_acc = torch.empty((splits, num_tokens, num_heads, head_dim), device=q.device, dtype=torch.float32)
            part_m = torch.empty((splits, num_tokens, num_heads), device=q.device, dtype=torch.float32)
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # never written (NUM_SPLITS == 1)

        block_tables = meta.block_tables.to(torch.int32)
        seq_lens = meta.seq_lens.to(torch.int32)
        query_start_loc = meta.query_start_loc.to(torch.int32)
        extra = {} if interpreting else {"num_warps": 4, "num_stages": 2}
        fp8 = k_scale is not None
        if fp8:  # read as bytes and decoded in the kernel (see the module docstring)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        scales = (k_scale, v_scale) if fp8 else (out, out)  # never read without FP8_KV
        scale_strides = (*k_scale.stride(), *v_scale.stride()) if fp8 else (0,) * 6
        _paged_attention_kernel[(grid0, num_kv_heads, splits)](
            out, q, k_cache, v_cache,
            *scales,
            block_tables, seq_lens, query_start_loc, alibi,
            out if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous(),
            part_acc, part_m, part_l,
            scale * _LOG2E,
            int(sliding_window or 0), float(softcap or 1.0),
            num_seqs,
            *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
            block_tables.stride(0),
            *scale_strides,
            num_tokens * num_heads if splits > 1 else 0, num_heads if splits > 1 else 0, 1 if splits > 1 else 0,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            GROUP=group, GROUP_P=group_p,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            PAGE_SIZE=page_size,
            NUM_SPLITS=splits,
            USE_ALIBI=alibi_slopes is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
            UPCAST=upcast,
            FP8_KV=fp8,
            SOFTCAP=bool(softcap),
            SINKS=sinks is not None,
            **extra,
        )
        if splits > 1:
            # Combine the splits' partial softmaxes: weights 2^(m_s - max_s m_s) (an empty split has m = -inf).
            m_max = part_m.amax(0)
            w = torch.exp2(part_m - m_max)
            denom = (w * part_l).sum(0)
            out.copy_((w.unsqueeze(-1) * part_acc).sum(0) / denom.unsqueeze(-1))
        return out


__all__ = ["TritonAttentionBackend"]
