"""What every attention backend sees: a flat batch of query tokens over a paged KV cache.

A step's batch is "flat": the new tokens of every scheduled sequence are concatenated (prefill chunks and single
decode tokens alike). Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q/k/v; its whole context
(cached tokens followed by the new ones) is `seq_lens[i]` tokens long and lives in the blocks listed in
block_tables[i]. Keys and values of the new tokens are written to the cache (slot_mapping) before attention
runs, so a backend reads every key/value from the cache.

Cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of sequence i sits in block block_tables[i][p // block_size], offset p % block_size;
its slot is block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Python copies of the small per-sequence vectors, for backends that loop or plan on the host.
    query_lens_list: list[int] = field(default_factory=list)
    seq_lens_list: list[int] = field(default_factory=list)
    # True when every sequence has query length 1 (a pure decode step).
    is_decode_only: bool = False
    # Per-step scratch shared by all layers (a backend stores index tensors or masks it builds once per step).
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' keys/values ([T, kv_heads, head_dim]) into their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class AttentionBackend:
    """Computes attention for a flat batch; keys/values are already in the cache."""

    name: str = "base"
    supports_alibi: bool = True
    # A decode step's forward reads only tensor metadata (host-side values at most as upper bounds that size the
    # work), so it can be captured into a graph once and replayed (see execution/graph_capture.py).
    graph_capture_safe: bool = False

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """(usable, reason when not) on this device."""
        return True, ""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32, this rank's heads only
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        raise NotImplementedError
