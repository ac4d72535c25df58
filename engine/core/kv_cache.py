"""The KV block pool: fixed-size blocks, a free queue, reference counts and the prefix cache.

A block is free when no sequence references it. Free blocks wait in an LRU queue; a free block may still hold
cached content (it keeps its hash) until it is handed out again, which evicts that content. A full block's
hash chains the previous block's hash with the block's token ids, so equal hashes mean equal prefixes
(shoal.engine.kv_hash: reproducible in any process, so routers can recompute them).

With `events` on, the pool records what a KV-cache index outside the engine needs (KV events, kv_events.py):
a block whose hash is registered (stored), a cached block whose content is dropped (removed) and a reset (all
cleared), in order; the engine takes them after each step (`take_events`).

With offloading on (core/kv_tiers.py), the pool also lists the cached blocks it evicts, (hash, block id), so their
content is copied to the offload tiers before a step overwrites it (`take_evicted`), and blocks read back from a
tier are registered like computed ones (`register_loaded`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shoal.engine.kv_hash import event_extra_keys
from shoal.engine.kv_hash import hash_chain as _hash_chain
from shoal.engine.kv_hash import lora_root as chain_root

# Event tuples, as vLLM's KV-event classes name them (kv_events.py encodes them):
#   ("BlockStored", block_hashes, parent_block_hash | None, token_ids, lora_id | None[, None, extra_keys])
#     (extra_keys, only when a block holds image tokens: per block its image digests in hex, or None)
#   ("BlockRemoved", block_hashes)
#   ("AllBlocksCleared",)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and computed (prefix caching only)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, events: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first). Values unused: an ordered set.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.events: list[tuple] | None = [] if events and enable_prefix_caching else None
        self.evicted: list[tuple[int, int]] | None = None  # (hash, block id) evicted, when offloading is on

    def take_evicted(self) -> list[tuple[int, int]]:
        """The cached blocks evicted since the last call, (hash, block id): their content is intact until the next
        step runs."""
        if not self.evicted:
            return []
        out, self.evicted = self.evicted, []
        return out

    def take_events(self) -> list[tuple]:
        """The KV events recorded since the last call (none when events are off)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (evicting cached content if needed); the caller checked num_free."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out, removed = [], []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                removed.append(block.block_hash)
                if self.evicted is not None:
                    self.evicted.append((block.block_hash, block_id))
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        if removed and self.events is not None:
            self.events.append(("BlockRemoved", removed))
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are queued first so they are evicted first: a
        sequence's leading blocks are the ones other requests are likely to share."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:  # a double free would hand one block to two sequences
                raise AssertionError(f"KV block {block_id} freed while unreferenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)  # no content worth keeping: reuse first
                else:
                    self._free[block_id] = None

    def reference_cached(self, block_hashes: list[int]) -> list[int]:
        """Take a reference to the cached blocks of the leading `block_hashes` (up to the first not cached), so they
        cannot be evicted until `free`d; their ids."""
        ids = []
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            ids.append(block_id)
        return ids

    def cached_block(self, block_hash: int) -> int | None:
        """The id of the block the prefix cache holds under `block_hash` (None: not cached); takes no reference."""
        return self._cached.get(block_hash)

    def lookup_prefix(self, token_ids: list[int], max_tokens: int, salt: int | None = None, usable=None,
                      extra_keys=None) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks that prefixes token_ids, covering at most max_tokens tokens.
        Returns (block ids, their hashes); the blocks are referenced (the caller owns them now). `usable(hashes)`,
        where given, says how many of the leading blocks found the caller can use (a hybrid model: only up to a
        block whose recurrent state is kept); only those are taken and counted as hits. `extra_keys`: the
        sequence's per-block extra hash keys (its images; kv_hash.hash_chain)."""
        if not self.enable_prefix_caching:
            return [], []
        self.prefix_queries += max_tokens
        ids, hashes = [], []
        for h in _hash_chain(token_ids[:max_tokens], self.block_size, 0, chain_root(salt), extra_keys):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
            hashes.append(h)
        if usable is not None:
            n = usable(hashes)
            ids, hashes = ids[:n], hashes[:n]
        for block_id in ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        self.prefix_hits += len(ids) * self.block_size
        return ids, hashes

    def cache_full_blocks(self, token_ids: list[int], block_ids: list[int], block_hashes: list[int],
                          num_computed_tokens: int, salt: int | None = None, extra_keys=None) -> None:
        """Publish a sequence's blocks that are now full and computed, extending its chain of block hashes in
        place (block_hashes[i] is block_ids[i]'s). First writer wins: a duplicate block stays private."""
        if not self.enable_prefix_caching:
            return
        done = len(block_hashes)
        computed = token_ids[:num_computed_tokens - num_computed_tokens % self.block_size]
        parent = block_hashes[-1] if block_hashes else chain_root(salt)
        stored: list[int] = []  # a run of newly registered blocks: one BlockStored event
        for i, h in enumerate(_hash_chain(computed, self.block_size, done, parent, extra_keys), start=done):
            block_hashes.append(h)
            new = h not in self._cached
            if new:
                self._cached[h] = block_ids[i]
                self.blocks[block_ids[i]].block_hash = h
            # A block holding image tokens is published with its image digests (its event's extra_keys), which its
            # hash covers: a router recomputes the hash from them (kv_hash.extra_from_event).
            if new and self.events is not None:
                if not stored:
                    start = i
                stored.append(h)
            elif stored:
                self._stored(stored, start, token_ids, block_hashes, salt, extra_keys)
                stored = []
        if stored:
            self._stored(stored, start, token_ids, block_hashes, salt, extra_keys)

    def register_loaded(self, token_ids: list[int], block_ids: list[int], chain: list[int], salt: int | None = None,
                        extra_keys=None) -> int:
        """Publish blocks a sequence just read back from an offload tier: `chain` is the sequence's block hashes
        and block_ids hold its last len(block_ids) blocks. As with computed blocks, the first writer wins: a block
        whose hash the pool already caches stays private. Returns how many were published."""
        start = len(chain) - len(block_ids)
        stored: list[int] = []
        for block_id, h in zip(block_ids, chain[start:]):
            if h in self._cached:
                break  # the rest stay private too: one event covers one contiguous run
            self._cached[h] = block_id
            self.blocks[block_id].block_hash = h
            stored.append(h)
        if stored and self.events is not None:
            self._stored(stored, start, token_ids, chain, salt, extra_keys)
        return len(stored)

    def _stored(self, hashes: list[int], start: int, token_ids: list[int], chain: list[int], salt: int | None,
                extra_keys=None) -> None:
        """Record that blocks start.. of a sequence (hashes `hashes`) are now cached. A chain's first block has no
        parent (None, as vLLM publishes it); its root is the adapter's (`lora_id`, kv_hash.lora_root). A run with
        image blocks also carries each block's image digests (None for a text block): vLLM's extra_keys."""
        bs = self.block_size
        tokens = list(token_ids[start * bs:(start + len(hashes)) * bs])
        event = ("BlockStored", hashes, chain[start - 1] if start else None, tokens, salt)
        if extra_keys is not None:
            keys = [event_extra_keys(extra_keys(i)) for i in range(start, start + len(hashes))]
            if any(k is not None for k in keys):
                event += (None, keys)  # no medium of its own: the pool's
        self.events.append(event)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's content (vLLM's reset_prefix_cache). Refused (False) while any block is
        referenced: a running sequence's blocks would stay registered under hashes the index no longer has."""
        if any(b.ref_count for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(("AllBlocksCleared",))
        return True

    def prefix_hash(self, token_ids: list[int], num_blocks: int, salt: int | None = None, extra_keys=None) -> int:
        """The chained hash of the first num_blocks full blocks of token_ids (the key of their prefix; with the
        sequence's images, `extra_keys`, as lookup_prefix hashes them)."""
        return list(_hash_chain(token_ids[:num_blocks * self.block_size], self.block_size, 0, chain_root(salt),
                                extra_keys))[-1]

    def check_all_free(self) -> None:
        """Raise if any block is still referenced (used by tests and on shutdown)."""
        held = [b.block_id for b in self.blocks if b.ref_count]
        if held or len(self._free) != self.num_blocks:
            raise AssertionError(f"KV blocks still referenced: {held[:20]} ({len(held)} in all)")
