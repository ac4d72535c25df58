"""The recurrent-state slots of a hybrid model (Gated DeltaNet / Mamba layers next to paged attention).

A recurrent layer keeps a fixed-size state per sequence (its conv window and its recurrence matrix) instead of
keys and values per token. Every rank allocates `num_slots` of them per recurrent layer (models/hybrid.py); rank 0
hands one slot to each sequence when it starts running and takes it back when the sequence finishes, is aborted or
is preempted (its state is then recomputed from its tokens on resumption, like its KV blocks). The slots are carved
from the same memory budget as the KV blocks, one per sequence --max-num-seqs allows.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:  # the scheduler runs at most max_num_seqs sequences, one slot each
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:  # a double free would share one state
            raise AssertionError(f"recurrent-state slot {slot} freed while not in use")
        self._free.append(slot)

    def check_all_free(self) -> None:
        if len(self._free) != self.num_slots:
            held = sorted(set(range(self.num_slots)) - set(self._free))
            raise AssertionError(f"recurrent-state slots still in use: {held[:20]} ({len(held)} in all)")


class StateCheckpoints:
    """Prefix caching for hybrids: copies of a sequence's recurrent state taken at a block boundary, keyed by the
    hash of the block that ends there (kv_cache's hash chain, so the key covers every token before the boundary).

    A cached KV prefix is usable by a hybrid only up to a boundary whose state is kept: the scheduler cuts each
    prompt's prefill at its last full block (the boundary a repeated prompt resumes from) and the step copies the
    state there into a checkpoint slot; a later request with that prefix starts from a copy of it. Checkpoint slots
    follow the sequences' slots in the same state tensors; the least recently used one is overwritten first."""

    def __init__(self, first_slot: int, num_slots: int):
        from collections import OrderedDict

        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first

    def get(self, block_hash: int) -> int | None:
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def put(self, block_hash: int) -> int | None:
        """The slot to copy the state at `block_hash`'s boundary into (None: already kept)."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        self._by_hash[block_hash] = slot
        return slot
