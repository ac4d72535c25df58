"""One rank's KV offloading: copies blocks between its KV cache and its tiers (kv_connector.py), off the step.

The engine decides what moves (core/kv_tiers.py) and every rank of a parallel group moves its own shard of the
same blocks, so the tiers of every rank hold the same hashes:
- save: blocks the pool just evicted (their content is overwritten from the next step on) are copied out. The
  step waits only for that copy: on a GPU it runs on a copy stream into pinned memory and the step's stream waits
  for it on the device; on the CPU it is one index_select per cache tensor. Handing the copies to the tiers (the
  CPU tier's spill to disk, with its checksum and file write) happens on the copy thread.
- load: a prefix that missed the pool but hits a tier is read back into fresh blocks before the prefill. Blocks
  still on their way to the tiers are served from the pending copies.
- changes (KV events, rank 0 only, when the engine publishes them): every change of what a tier holds is logged
  as it happens, under the tiers' lock (on the copy thread for stores and the blocks they push out, on the
  engine's for removals), so the log is in the tiers' own order; the engine takes it after each step and
  publishes it behind the pool's events (core/kv_tiers.py). A pending copy is not in a tier yet: it is announced
  once the copy thread has handed it over.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from shoal.engine.execution.kv_connector import KVConnector
from shoal.engine.execution.kv_cpu_tier import CPUTier
from shoal.engine.execution.kv_disk_tier import DiskTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadSpec:
    """What every rank builds its tiers from (the engine sizes them in blocks, the same on every rank)."""

    cpu_blocks: int
    disk_blocks: int = 0
    disk_path: str | None = None
    report_changes: bool = False  # rank 0 logs what its tiers store and drop (the engine publishes KV events)


class BlockLayout:
    """Where one block's K, V (and fp8 scales) of every layer of this rank sit in the block's flat bytes."""

    def __init__(self, kv_caches: list):
        self.tensors = [t for c in kv_caches if c is not None for t in c.tensors()]
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.nbytes = sum(self.sizes)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' bytes, [n, nbytes] uint8 on the cache's device (on the current stream). One cat of whole
        rows: copies into byte-strided columns run element by element, ~40x slower on the CPU."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        n = len(block_ids)
        return torch.cat([t.index_select(0, idx).reshape(n, -1).view(torch.uint8) for t in self.tensors], dim=1)

    def scatter(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write each block's bytes (flat uint8 on the host) into its block. Each tensor's columns are viewed in its
        own dtype in place: byte-wise copies and index_copy_ on uint8 are element by element, ~100x slower."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        rows = torch.stack(data).to(self.device)
        n, off = len(block_ids), 0
        for t, size in zip(self.tensors, self.sizes):
            part = rows[:, off:off + size]
            try:
                part = part.view(t.dtype)
            except RuntimeError:  # an offset that is no multiple of the element size: copy to align
                part = part.contiguous().view(t.dtype)
            t.index_copy_(0, idx, part.view(n, *t.shape[1:]))
            off += size


class KVOffloader:
    """This rank's tiers (CPU, then disk) and the copy thread that fills them."""

    def __init__(self, runner, spec: OffloadSpec, rank: int = 0):
        self.runner = runner
        layout = BlockLayout(runner.kv_caches)
        self.block_nbytes = layout.nbytes
        disk = None
        if spec.disk_blocks:
            disk = DiskTier(f"{spec.disk_path}/rank-{rank}", spec.disk_blocks, layout.nbytes)
        self.tiers: list[KVConnector] = [CPUTier(spec.cpu_blocks, layout.nbytes, spill=disk)]
        if disk is not None:
            self.tiers.append(disk)
        self._changes: deque[tuple[str, str, int]] | None = None  # (kind, tier, hash), oldest first
        if spec.report_changes and rank == 0:
            self._changes = deque()
            for tier in self.tiers:
                tier.changed = lambda kind, name, h: self._changes.append((kind, name, h))
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}  # hash -> (bytes, CUDA event | None)
        self._lock = threading.Lock()  # the tiers: the copy thread vs loads, lookups and removals
        self._queue: queue.Queue = queue.Queue()
        self._stream = torch.cuda.Stream(layout.device) if layout.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # -- save ----------------------------------------------------------------------------------------------
    def save(self, saves: list[tuple[int, int]]) -> None:
        """Copy out (block hash, block id) pairs the pool evicted; the tiers take them on the copy thread."""
        saves = [(h, b) for h, b in saves if h not in self._pending]
        if not saves:
            return
        layout = BlockLayout(self.runner.kv_caches)  # rebuilt: wake_up reallocates the cache
        n, event = len(saves), None
        if self._stream is not None:
            out = torch.empty(n, layout.nbytes, dtype=torch.uint8, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(layout.device))  # the steps that wrote them
            with torch.cuda.stream(self._stream):
                out.copy_(layout.gather([b for _, b in saves]), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            torch.cuda.current_stream(layout.device).wait_stream(self._stream)  # overwrite only once copied
        else:
            out = layout.gather([b for _, b in saves])  # the copy itself: the step may overwrite the blocks now
        for i, (h, _) in enumerate(saves):  # a dict store is atomic: no lock, so a save never waits for a disk write
            self._pending[h] = (out[i], event)
        self._queue.put([h for h, _ in saves])

    def _run(self) -> None:
        try:  # Linux: each thread has its own nice value; the step's threads come first for the cores
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            hashes = self._queue.get()
            try:
                if hashes is None:
                    return
                for h in hashes:
                    entry = self._pending.get(h)
                    if entry is None:  # cleared meanwhile
                        continue
                    data, event = entry
                    if event is not None:
                        event.synchronize()
                    with self._lock:  # one block at a time: a load waits for one disk write at most
                        if self._pending.get(h) is entry:
                            self.tiers[0].store(h, data)  # in its tier before it leaves _pending: always found
                            del self._pending[h]
            finally:
                self._queue.task_done()

    def transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> int:
        """Save, then load (saves first: a load may reuse a block just evicted); how many loads completed."""
        self.save(saves)
        return self.load(loads) if loads else 0

    # -- lookup / load -------------------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[str]:
        """The tier of each leading block held (pending copies count as the CPU tier's)."""
        out = []
        with self._lock:
            for h in hashes:
                tier = "cpu" if h in self._pending else next((t.name for t in self.tiers if t.lookup([h])), None)
                if tier is None:
                    break
                out.append(tier)
        return out

    def load(self, loads: list[tuple[int, int]]) -> int:
        """Read (block hash, block id) pairs back into the cache, in order, up to the first block no tier holds
        intact; how many were loaded."""
        found: list[torch.Tensor] = []
        with self._lock:
            for h, _ in loads:
                data = self._read(h)
                if data is None:
                    break
                found.append(data)
        if found:
            BlockLayout(self.runner.kv_caches).scatter([b for _, b in loads[:len(found)]], found)
        return len(found)

    def _read(self, h: int) -> torch.Tensor | None:
        pending = self._pending.get(h)
        if pending is not None:
            data, event = pending
            if event is not None:
                event.synchronize()
            return data
        for tier in self.tiers:
            if tier.lookup([h]):
                return tier.load(h)  # None: damaged (dropped by the tier)
        return None

    def read(self, h: int) -> torch.Tensor | None:
        """One block's bytes from the tiers (or a pending copy), or None (not held, or damaged)."""
        with self._lock:
            return self._read(h)

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """Keep blocks that arrived from another engine (prefill/decode disaggregation) in the first tier, where
        the next prefix lookup finds them."""
        with self._lock:
            for h, data in items:
                self.tiers[0].store(h, data)

    def remove(self, hashes: list[int]) -> None:
        with self._lock:
            for h in hashes:
                self._pending.pop(h, None)
                for tier in self.tiers:
                    tier.remove(h)

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
            for tier in self.tiers:
                tier.clear()
            if self._changes is not None:
                self._changes.clear()  # what they held before is gone: the engine reports the reset as a whole

    def take_changes(self) -> list[tuple[str, str, int]]:
        """The tiers' changes logged since the last call, in order: (event kind, tier name, block hash). The
        copy thread appends meanwhile (a deque is safe for one appender and one taker)."""
        out = []
        changes = self._changes
        while changes:
            out.append(changes.popleft())
        return out

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (this rank's): blocks held, bytes used, capacity in bytes, blocks found damaged, and blocks
        pending (copied out of the pool, not yet handed to the tier; they count as held by the CPU tier, whose
        memory they are in). Read without the lock (sizes of dicts only), so a scrape never waits for a disk write."""
        out = {t.name: {"blocks": len(t), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                        "corrupted": getattr(t, "corrupted", 0), "pending": 0} for t in self.tiers}
        pending = len(self._pending)
        out["cpu"]["blocks"] += pending
        out["cpu"]["used_bytes"] += pending * self.block_nbytes
        out["cpu"]["pending"] = pending
        return out

    def wait_idle(self) -> None:
        """Wait until the copy thread has handed every copy so far to the tiers (tests, benchmarks)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


def export_blocks(runner, offload: KVOffloader | None, pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """This rank's bytes of each (block hash, block id) pair, in order, up to the first it cannot give: a block id
    of -1 is read from the offload tiers, any other from the KV cache (the engine calls between steps, so the
    block is not being written)."""
    cached = [b for _, b in pairs if b >= 0]
    rows = iter(BlockLayout(runner.kv_caches).gather(cached).cpu()) if cached else iter(())
    out = []
    for h, b in pairs:
        data = next(rows) if b >= 0 else offload.read(h) if offload is not None else None
        if data is None:
            break
        out.append(data)
    return out


def block_nbytes(runner) -> int:
    """One block's bytes of this rank's shard of the KV cache."""
    return BlockLayout(runner.kv_caches).nbytes

