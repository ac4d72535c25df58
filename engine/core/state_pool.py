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
