"""The engine's side of KV offloading (--kv-offloading-size, --kv-offloading-disk-*): which blocks move between
the KV pool and the offload tiers, and when.

The ranks hold the bytes (execution/kv_offload.py: a CPU tier, then a disk tier, behind execution/kv_connector's
interface); this side only names blocks by hash and block id:
- blocks the pool evicts are saved before the next step overwrites them (`flush`, called right before every step
  runs, and before any load that could reuse their blocks);
- a prompt whose prefix misses the pool looks the following blocks up in the tiers; those found are read into
  fresh pool blocks before its prefill, registered in the prefix cache and counted as cached (`extend_prefix`).
  A block that fails to load on any rank (damaged on disk, or dropped by one rank's tier) ends the run there:
  it and what follows are computed again.

With KV events on, what the tiers store and drop is published behind the pool's own events of the same step, in
the tiers' order (`take_events`): a block the pool evicts is BlockRemoved from the device's medium first, then
BlockStored in the CPU tier's once the copy thread has put it there; one the CPU tier pushes to disk is removed
from the CPU medium and stored in the disk's; one the last tier lets go is removed from its medium. A reset is the
pool's AllBlocksCleared (the tiers' log is emptied with them).

Hits are counted per tier in tokens (the pool's own hits are the "device" tier), next to the pool's
prefix_queries, for the vllm:prefix_cache_* style metrics.
"""

from __future__ import annotations

from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.sequence import Sequence
from shoal.engine.kv_hash import hash_chain, lora_root

TIERS = ("cpu", "disk")


class KVTiers:
    def __init__(self, executor, pool: BlockPool):
        self.executor = executor
        self.hits = dict.fromkeys(TIERS, 0)  # tokens served from each tier
        self.attach(pool)

    def attach(self, pool: BlockPool) -> None:
        """Follow `pool` (a new one after wake_up): record what it evicts."""
        self.pool = pool
        pool.evicted = []

    def flush(self) -> None:
        """Save the blocks the pool evicted since the last call (their content is still intact)."""
        saves = self.pool.take_evicted()
        if saves:
            self.executor.kv_transfer(saves, [])

    def extend_prefix(self, seq: Sequence, usable_tokens: int) -> None:
        """After the pool's prefix lookup: read the sequence's next full blocks (within usable_tokens) that a tier
        holds into fresh blocks and append them to its blocks, as cached."""
        bs = self.pool.block_size
        done, full = len(seq.block_hashes), usable_tokens // bs
        if full <= done:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else lora_root(seq.lora_id)
        hashes = list(hash_chain(seq.token_ids[:full * bs], bs, done, parent))
        tiers = self.executor.kv_lookup(hashes)
        n = min(len(tiers), self.pool.num_free)
        if not n:
            return
        ids = self.pool.allocate(n)  # may evict: those saves go first, in the same call
        loaded = self.executor.kv_transfer(self.pool.take_evicted(), list(zip(hashes[:n], ids)))
        if loaded < n:
            self.pool.free(ids[loaded:])
        if not loaded:
            return
        seq.block_ids = seq.block_ids + ids[:loaded]
        seq.block_hashes = seq.block_hashes + hashes[:loaded]
        self.pool.register_loaded(seq.token_ids, ids[:loaded], seq.block_hashes, seq.lora_id,
                                  seq.images.block_key if seq.images is not None else None)
        for tier in tiers[:loaded]:
            self.hits[tier] += bs

    def clear(self) -> None:
        self.pool.take_evicted()
        self.executor.kv_clear()

    def take_events(self, media: dict[str, str]) -> list[tuple]:
        """What the tiers stored and dropped since the last call, as KV event tuples (kv_cache.py's, with the
        tier's medium, `media[tier]`, as a last field); a run of one kind in one tier is one event. A tier keeps no
        tokens or parent: its BlockStored has neither (as vLLM's offloading connector sends them)."""
        out: list[tuple] = []
        for kind, tier, h in self.executor.kv_take_changes():
            medium = media[tier]
            if out and out[-1][0] == kind and out[-1][-1] == medium:
                out[-1][1].append(h)
            elif kind == "BlockStored":
                out.append((kind, [h], None, [], None, medium))
            else:
                out.append((kind, [h], medium))
        return out

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier (rank 0's): blocks held, bytes used and capacity."""
        return self.executor.kv_offload_stats()
