"""The KV connector: where blocks evicted from the KV pool go, keyed by the prefix cache's block hash.

One interface for every place a block's KV bytes can be kept outside the pool: the CPU-memory tier
(kv_cpu_tier.py), the local-disk tier (kv_disk_tier.py) and, later, a store shared by several engines (LMCache,
Mooncake) behind the same four calls. A block's bytes are one flat uint8 tensor of this rank's shard: every layer's
K, V (and fp8 scales) of the block, in the order kv_offload.BlockLayout lays them out, so a connector never needs
to know the model.

Block hashes chain (kv_hash.py): a block's hash names its whole prefix, so equal hashes mean equal KV, and a
connector may keep any block it is given and serve it to any request that looks the hash up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

import torch


class KVConnector(ABC):
    """Stores and serves KV blocks by block hash. Calls come from one thread at a time (kv_offload's copy thread
    stores; loads and lookups wait for it to go idle or take its lock), so a connector needs no locking of its own."""

    name: str  # the tier's label in metrics and logs: "cpu", "disk", or the shared store's name

    @abstractmethod
    def store(self, block_hash: int, data: torch.Tensor) -> None:
        """Keep `data` (one block's bytes, flat uint8) under `block_hash`; a hash already held is refreshed. The
        connector may drop other blocks to make room, or decline to keep this one."""

    @abstractmethod
    def lookup(self, block_hashes: list[int]) -> int:
        """How many of the leading `block_hashes` this connector holds (it stops at the first it lacks)."""

    @abstractmethod
    def load(self, block_hash: int) -> torch.Tensor | None:
        """The block's bytes, or None when the connector does not hold it or what it held is damaged (a damaged
        block is dropped: it is recomputed, never served)."""

    @abstractmethod
    def remove(self, block_hash: int) -> None:
        """Forget the block (nothing happens when it is not held)."""

    def clear(self) -> None:
        """Forget every block (a prefix-cache reset: the KV may no longer match the weights)."""

    def __len__(self) -> int:
        return 0

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def capacity_bytes(self) -> int:
        return 0


Changed = Callable[[str, str, int], None]  # (event kind, tier name, block hash): what the tier now holds or dropped


class LRUTier(KVConnector):
    """A tier holding up to `capacity_blocks` blocks of `block_nbytes` each, least recently used first in `_blocks`
    (hash -> what the tier keeps for it): the bookkeeping the CPU and disk tiers share.

    `changed`, when set, hears every change of what the tier holds, as it happens: ("BlockStored", name, hash)
    for a block it did not hold, ("BlockRemoved", name, hash) for one it lets go (pushed out, removed, found
    damaged); a refresh is no change, and `clear` reports nothing (its caller reports the reset as a whole)."""

    changed: Changed | None = None

    def __init__(self, capacity_blocks: int, block_nbytes: int):
        if capacity_blocks < 1:
            raise ValueError(f"the {self.name} offload tier needs room for at least one block")
        self.capacity_blocks = capacity_blocks
        self.block_nbytes = block_nbytes
        self._blocks: OrderedDict[int, object] = OrderedDict()  # oldest first

    def store(self, block_hash: int, data: torch.Tensor) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while len(self._blocks) >= self.capacity_blocks:
            old, kept = self._blocks.popitem(last=False)
            self._report("BlockRemoved", old)  # before the next tier reports it stored: one holder at a time
            self._evict(old, kept)
        self._put(block_hash, data)
        if block_hash in self._blocks:
            self._report("BlockStored", block_hash)

    def remove(self, block_hash: int) -> None:
        if block_hash not in self._blocks:
            return
        self._report("BlockRemoved", block_hash)
        self._discard(block_hash, self._blocks.pop(block_hash))

    def clear(self) -> None:
        for h, kept in list(self._blocks.items()):
            self._discard(h, kept)
        self._blocks.clear()

    def _report(self, kind: str, block_hash: int) -> None:
        if self.changed is not None:
            self.changed(kind, self.name, block_hash)

    @abstractmethod
    def _evict(self, block_hash: int, kept: object) -> None:
        """The least recently used block leaves to make room (what the tier kept for it is passed)."""

    def _discard(self, block_hash: int, kept: object) -> None:
        """A block is removed or cleared (what the tier kept for it is passed): nothing to do by default."""

    @abstractmethod
    def _put(self, block_hash: int, data: torch.Tensor) -> None:
        """Keep a new block (room has been made); record it in `_blocks` unless it could not be kept."""

    def lookup(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_nbytes
