"""Pickers: which engine gets a request.

prefix-load (default)
    1. Affinity. The gateway remembers, for every prompt block hash it routed, which engines served it last
       (an LRU index of `index_size` hashes). The request's chain is matched block by block; the engines
       holding the longest matching chain are preferred (ties: the less loaded one) — unless their load is
       over the bound below, in which case the next-longest holder is tried.
    2. Cold prefixes (no holder within the bound): bounded-load consistent hashing. The engines are ordered by
       rendezvous hash of (first block hash, engine URL), and the first one under the bound wins. Every gateway
       replica computes the same order from the same prompt, so replicas agree on where a new prefix lives
       without sharing any state; the bound spills a hot prefix over to the next engines in its order.
    Bounds. Cold placement: an engine may take the request while load + 1 <= ceil(c * (total load + 1) /
    engines) (Mirrokni et al.'s consistent hashing with bounded loads; c = load_factor, default 1.25) and its
    load is at most the least loaded engine's + `cold_slack` (default 1): a new prefix has no cache to win yet,
    so when the engines' loads differ (one runs slower, or is busy with long prompts) it goes where the queue is
    short, like least-load; while loads are even, every gateway replica still picks the same engine.
    Affinity is allowed a little more: also while load <= least load + `affinity_slack` (default 2), because a
    cached prefix saves a whole prefill while one more sequence in a running batch costs little — without it,
    at low concurrency any second request of a group would leave the engine that holds its prefix. Load is the
    gateway's in-flight count blended with the engine's polled queue (see Backend.load).
least-load
    The least loaded engine; ties rotate.
round-robin
    Every eligible engine in turn.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

from shoal.engine.gateway.backends import Backend

ROUTINGS = ("prefix-load", "least-load", "round-robin")


@dataclass
class Pick:
    backend: Backend
    decision: str  # affinity | cold | spill | least-load | round-robin
    matched_blocks: int = 0


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


class RoundRobin:
    name = "round-robin"

    def __init__(self):
        self._next = itertools.count()

    def pick(self, candidates: list[Backend], hashes: list[bytes], now: float) -> Pick:
        return Pick(candidates[next(self._next) % len(candidates)], "round-robin")

    def record(self, backend: Backend, hashes: list[bytes], now: float) -> None:
        pass


class LeastLoad:
    name = "least-load"

    def __init__(self):
        self._next = itertools.count()

    def pick(self, candidates: list[Backend], hashes: list[bytes], now: float) -> Pick:
        loads = [b.load(now) for b in candidates]
        low = min(loads)
        ties = [b for b, load in zip(candidates, loads) if load == low]
        return Pick(ties[next(self._next) % len(ties)], "least-load")

    def record(self, backend: Backend, hashes: list[bytes], now: float) -> None:
        pass


class PrefixLoad:
    name = "prefix-load"

    def __init__(self, load_factor: float = 1.25, affinity_slack: float = 2.0, cold_slack: float = 1.0,
                 index_size: int = 200_000, holders_per_block: int = 4):
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        if affinity_slack < 0 or cold_slack < 0:
            raise ValueError("affinity_slack and cold_slack must be >= 0")
        self.cold_slack = cold_slack
        self.load_factor = load_factor
        self.affinity_slack = affinity_slack
        self.index_size = index_size
        self.holders_per_block = holders_per_block
        # block hash -> {engine URL: last time it was routed there}, least recently used first.
        self.index: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def matches(self, candidates: list[Backend], hashes: list[bytes]) -> dict[str, int]:
        """Engine URL -> number of leading blocks of `hashes` it served last (only engines in `candidates`)."""
        alive = {b.url for b in candidates}
        matched: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self.index.get(h)
            if not holders:
                break
            alive = alive & holders.keys()
            if not alive:
                break
            for url in alive:
                matched[url] = i + 1
        return matched

    def pick(self, candidates: list[Backend], hashes: list[bytes], now: float) -> Pick:
        loads = {b: b.load(now) for b in candidates}
        capacity = math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(candidates))
        least = min(loads.values())
        affinity_limit = least + self.affinity_slack

        def within(b: Backend) -> bool:
            return loads[b] + 1 <= capacity

        matched = self.matches(candidates, hashes)
        if matched:
            holders = sorted((b for b in candidates if b.url in matched), key=lambda b: (-matched[b.url], loads[b]))
            for b in holders:
                if within(b) or loads[b] <= affinity_limit:
                    return Pick(b, "affinity", matched[b.url])
        key = hashes[0] if hashes else b""
        order = sorted(candidates, key=lambda b: _rendezvous(key, b.url), reverse=True)
        decision = "spill" if matched else "cold"
        for b in order:
            if within(b) and loads[b] <= least + self.cold_slack:
                return Pick(b, decision)
        return Pick(min(candidates, key=lambda b: loads[b]), decision)

    def record(self, backend: Backend, hashes: list[bytes], now: float) -> None:
        """Remember that `backend` now holds this chain (optimistically, at dispatch: the next request of the
        same group, even a concurrent one, goes to the same engine)."""
        index = self.index
        for h in hashes:
            holders = index.get(h)
            if holders is None:
                index[h] = {backend.url: now}
            else:
                index.move_to_end(h)
                holders.pop(backend.url, None)
                holders[backend.url] = now
                if len(holders) > self.holders_per_block:
                    del holders[next(iter(holders))]  # the least recently routed holder
        while len(index) > self.index_size:
            index.popitem(last=False)


def make_router(name: str, load_factor: float = 1.25, affinity_slack: float = 2.0, cold_slack: float = 1.0,
                index_size: int = 200_000):
    if name == "prefix-load":
        return PrefixLoad(load_factor=load_factor, affinity_slack=affinity_slack, cold_slack=cold_slack,
                          index_size=index_size)
    if name == "least-load":
        return LeastLoad()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing {name!r}; choose one of {', '.join(ROUTINGS)}")
