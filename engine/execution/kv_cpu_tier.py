"""The CPU-memory tier: KV blocks evicted from the pool, kept in host memory in least-recently-used order.

Its capacity is a number of blocks (the engine divides --kv-offloading-size by a block's bytes over every rank),
so every rank of a parallel group keeps and drops the same hashes in the same order. A block pushed out by a newer
one goes to the next tier (the disk tier) when there is one, else it is forgotten.
"""

from __future__ import annotations

import torch

from shoal.engine.execution.kv_connector import KVConnector, LRUTier


class CPUTier(LRUTier):
    name = "cpu"

    def __init__(self, capacity_blocks: int, block_nbytes: int, spill: KVConnector | None = None):
        super().__init__(capacity_blocks, block_nbytes)  # _blocks: hash -> the block's bytes
        self.spill = spill

    def _evict(self, block_hash: int, kept: object) -> None:
        if self.spill is not None:
            self.spill.store(block_hash, kept)

    def _put(self, block_hash: int, data: torch.Tensor) -> None:
        self._blocks[block_hash] = data

    def load(self, block_hash: int) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data
