"""The CPU-memory tier: KV blocks evicted from the pool, kept in host memory in least-recently-used order.

Its capacity is a number of blocks (the engine divides --kv-offloading-size by a block's bytes over every rank),
so every rank of a parallel group keeps and drops the same hashes in the same order. A block pushed out by a newer
one goes to the next tier (the disk tier) when there is one, else it is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from shoal.engine.execution.kv_connector import KVConnector


class CPUTier(KVConnector):
    name = "cpu"

    def __init__(self, capacity_blocks: int, block_nbytes: int, spill: KVConnector | None = None):
        if capacity_blocks < 1:
            raise ValueError("the CPU offload tier needs room for at least one block")
        self.capacity_blocks = capacity_blocks
        self.block_nbytes = block_nbytes
        self.spill = spill
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first

    def store(self, block_hash: int, data: torch.Tensor) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while len(self._blocks) >= self.capacity_blocks:
            old_hash, old = self._blocks.popitem(last=False)
            if self.spill is not None:
                self.spill.store(old_hash, old)
        self._blocks[block_hash] = data

    def lookup(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def load(self, block_hash: int) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def remove(self, block_hash: int) -> None:
        self._blocks.pop(block_hash, None)

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_nbytes
