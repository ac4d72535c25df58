"""FlashAttention-2 over the paged KV cache, when the `flash_attn` package is installed on a CUDA device.

One call per layer for the whole flat batch: `flash_attn_varlen_func(q, k, v, cu_seqlens_q=query_start_loc,
cu_seqlens_k=prefix sums of seq_lens, causal=True)`. flash-attn aligns the causal mask to the bottom right, so
a sequence's query i (of query_len) sees keys 0..seq_len - query_len + i: exactly chunked prefill and decode.

Paged KV: upstream flash-attn 2.x (Dao-AILab, up to 2.8) reads a paged cache directly (`block_table=`) only when
the page size is a multiple of 256 ("Paged KV cache block size must be divisible by 256"); its public
`flash_attn_varlen_func` takes the per-sequence key lengths from `cu_seqlens_k` (`seqused_k` is not exposed).
With such a block size we pass the cache and block table straight through; with any other block size (the
default 16) we gather each sequence's keys/values by block table into one contiguous varlen buffer first.

FP8 KV cache (--kv-cache-dtype fp8): flash-attn 2 has no fp8 input, so the context's keys/values are always
gathered (whatever the block size) and dequantized to the compute dtype with their row scales on the way. That
costs a gathered copy per layer like the default block size does, in exchange for the cache's halved footprint.

Constraints (see `check_config`): float16/bfloat16 only, head_dim <= 256 and a multiple of 8, Ampere or newer.
ALiBi models are refused: BLOOM-style ALiBi is not supported by the flash backend here. Models with attention sinks
(gpt-oss) are refused too: flash-attn 2's public API has no sink term (vLLM runs them on its own FlashAttention 3
fork's `s_aux`), so `auto` takes the Triton kernel for them.
"""

from __future__ import annotations

import importlib.util

import torch

from shoal.engine.execution.attention.base import (AttentionBackend, AttentionMetadata, check_blocks_and_heads,
                                                   dequantize_fp8)

ALIBI_REFUSAL = (
    "the flash attention backend does not support models with ALiBi positional bias (BLOOM-style ALiBi is "
    "not supported by the flash backend here); use --attention-backend triton or --attention-backend sdpa"
)
SINKS_REFUSAL = (
    "the flash attention backend cannot add attention sinks (gpt-oss): flash-attn 2's flash_attn_varlen_func has no "
    "sink term; use --attention-backend triton or --attention-backend sdpa"
)

# flash-attn 2.x reads a paged cache in place only for page sizes that are multiples of this.
PAGED_BLOCK_MULTIPLE = 256


def _flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


class FlashAttentionBackend(AttentionBackend):
    """flash_attn.flash_attn_varlen_func over the paged cache (in place for block sizes that are multiples
    of 256, gathered by block table otherwise). Refuses ALiBi models and float32."""

    name = "flash"
    supports_alibi = False
    supports_fp8_kv = True

    def __init__(self) -> None:
        self._varlen = None

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, "the flash backend needs a CUDA device"
        if not _flash_attn_installed():
            return False, "flash_attn is not installed (pip install flash-attn)"
        if not torch.cuda.is_available():
            return False, "the flash backend needs a CUDA device (CUDA is not available)"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return False, f"flash-attn 2 needs an Ampere or newer GPU (compute capability >= 8.0, got {major}.{minor})"
        try:
            from flash_attn import flash_attn_varlen_func  # noqa: F401
        except Exception as exc:  # a broken build (ABI mismatch with torch) fails here, not at find_spec
            return False, f"flash_attn is installed but cannot be imported: {exc}"
        return True, ""

    @classmethod
    def check_config(cls, *, head_dim: int, dtype: torch.dtype, block_size: int, uses_alibi: bool = False,
                     num_heads: int | None = None, num_kv_heads: int | None = None) -> tuple[bool, str]:
        """(usable, reason when not) for a model/cache configuration, independent of the device."""
        if uses_alibi:
            return False, ALIBI_REFUSAL
        if dtype not in (torch.float16, torch.bfloat16):
            return False, (f"the flash backend supports float16 and bfloat16 only, not {dtype}; "
                           "use --dtype float16/bfloat16, or --attention-backend triton or sdpa")
        if head_dim > 256 or head_dim % 8:
            return False, f"the flash backend needs head_dim <= 256 and a multiple of 8 (got {head_dim})"
        return check_blocks_and_heads(block_size, num_heads, num_kv_heads)

    @staticmethod
    def reads_cache_in_place(block_size: int) -> bool:
        """Whether flash-attn reads the paged cache directly (else keys/values are gathered per call)."""
        return block_size % PAGED_BLOCK_MULTIPLE == 0

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
        if alibi_slopes is not None:
            raise ValueError(ALIBI_REFUSAL)
        if sinks is not None:
            raise ValueError(SINKS_REFUSAL)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flash backend supports float16 and bfloat16 only, not {q.dtype}; "
                             "use --dtype float16/bfloat16, or --attention-backend triton or sdpa")
        if self._varlen is None:
            from flash_attn import flash_attn_varlen_func

            self._varlen = flash_attn_varlen_func
        num_tokens = q.shape[0]
        if num_tokens == 0:
            return torch.empty_like(q)
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        seq_lens = meta.seq_lens.to(torch.int32)
        cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens_k[1:])
        common = dict(
            cu_seqlens_q=meta.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
        )
        if sliding_window:  # flash-attn's window (left, right) counts keys beside the query: W keys = (W - 1, 0)
            common["window_size"] = (sliding_window - 1, 0)
        if softcap:  # flash-attn >= 2.6
            common["softcap"] = float(softcap)
        if k_scale is None and self.reads_cache_in_place(block_size):
            return self._varlen(q, k_cache, v_cache, block_table=meta.block_tables.to(torch.int32), **common)
        slots = self._context_slots(meta, block_size, q.device)
        k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_select(0, slots)
        v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_select(0, slots)
        if k_scale is not None:
            k = dequantize_fp8(k, k_scale.view(-1, num_kv_heads).index_select(0, slots), q.dtype)
            v = dequantize_fp8(v, v_scale.view(-1, num_kv_heads).index_select(0, slots), q.dtype)
        return self._varlen(q, k, v, **common)

    @staticmethod
    def _context_slots(meta: AttentionMetadata, block_size: int, device: torch.device) -> torch.Tensor:
        """Cache slot of every context token of every sequence, sequences concatenated (varlen key order)."""
        total = int(sum(meta.seq_lens_list))
        seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
        seq_ids = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=device), seq_lens,
                                          output_size=total)
        starts = torch.cumsum(seq_lens, 0) - seq_lens
        pos = torch.arange(total, device=device) - starts[seq_ids]
        blocks = meta.block_tables.to(device=device, dtype=torch.int64)[seq_ids, pos // block_size]
        return blocks * block_size + pos % block_size


__all__ = ["FlashAttentionBackend", "ALIBI_REFUSAL", "SINKS_REFUSAL"]
