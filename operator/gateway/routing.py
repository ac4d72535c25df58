"""Which engine gets a request: filters -> weighted scorers -> a picker, in profiles tried in order.

A Router runs its profiles in turn over the eligible engines. A profile narrows them with its filters (hard
constraints), sums its scorers' scores (each in [0, 1], higher is better) times their weights, and lets its picker
choose among the highest totals; a profile whose filters leave no engine hands over to the next one. Every
routing is such a composition, so new criteria (adapter affinity, priority) are one more Filter or Scorer.
The candidates for a request naming a LoRA adapter are already only the engines that list it (pool.py); among
them it goes where it is resident (prefix-load: first profile, within the affinity bound; least-load:
LoRAAffinityScorer ranks resident > a free adapter place > neither above load):

prefix-load (default)
    0. lora-affinity: for an adapter, engines within the affinity bound where it is resident, least loaded first.
       Past it, every profile below still scores a free adapter place above a full one (LoRAAffinityScorer).
    1. affinity: engines within the affinity bound (below) that hold the longest matching chain of the prompt's
       block hashes, least loaded first. The gateway remembers, for every block hash it routed, which engines
       served it last (PrefixIndex, an LRU of `index_size` hashes); the request's chain is matched block by block.
       An engine over the bound is passed over for the next-longest holder within it.
    2. cold (or spill, when some engine held part of the prefix but was over the bound): bounded-load consistent
       hashing. Among engines within the cold bound, the one ranked first by rendezvous hash of (first block
       hash, engine URL). Every gateway replica computes the same ranking from the same prompt, so replicas agree
       on where a new prefix lives without sharing any state; the bound spills a hot prefix over to the next
       engines in its order.
    3. otherwise the least loaded engine.
    Bounds. Cold placement: an engine may take the request while load + 1 <= ceil(c * (total load + 1) /
    engines) (Mirrokni et al.'s consistent hashing with bounded loads; c = load_factor, default 1.25) and its
    load is at most the least loaded engine's + `cold_slack` (default 1): a new prefix has no cache to win yet,
    so when the engines' loads differ (one runs slower, or is busy with long prompts) it goes where the queue is
    short, like least-load; while loads are even, every gateway replica still picks the same engine.
    Affinity is allowed a little more: either bound is enough, with load <= least load + `affinity_slack`
    (default 2), because a cached prefix saves a whole prefill while one more sequence in a running batch costs
    little — without it, at low concurrency any second request of a group would leave the engine that holds its
    prefix. Load is the gateway's in-flight count blended with the engine's polled queue (see Backend.load).
precise-prefix
    prefix-load's profiles, with the matched prefix taken from what the engines report holding (their KV events,
    kv_index.py) instead of what the gateway routed: the prompt's token ids (the model's tokenizer, kv_tokens.py,
    or an engine's /tokenize) hashed as the index keys blocks (shoal.engine.kv_hash: a Shoal engine's own hashes;
    a vLLM engine's are mapped to them), each engine scored by the leading blocks it holds, a block in an offload tier
    worth less than one in the KV cache (kv_index.TIER_WEIGHTS). Falls back to prefix-load's approximate index for a request without
    token ids (/tokenize unavailable) or when no engine reports holding any of its blocks (no events yet, or a
    prefix routed a moment ago whose blocks are not stored yet). A request naming a LoRA adapter is matched
    against the blocks each engine stored under that adapter (kv_index.py); the lora-affinity profile still
    comes first.
least-load
    The least loaded engine; ties rotate.
round-robin
    Every eligible engine in turn (no scorer: all tie, and ties rotate).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from shoal.operator.gateway.backends import Backend
from shoal.operator.gateway.kv_index import KVIndex


@dataclass
class Pick:
    backend: Backend
    decision: str  # affinity | cold | spill | least-load | round-robin
    matched_blocks: int = 0
    precise: bool = False  # matched_blocks counts KV blocks the engine reported holding (precise-prefix)


class PrefixIndex:
    """Block hash -> the engines that served it last (at most `holders_per_block`, by URL, with the time), least
    recently used hash first; at most `index_size` hashes."""

    def __init__(self, index_size: int = 200_000, holders_per_block: int = 4):
        self.index_size = index_size
        self.holders_per_block = holders_per_block
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


class RoutingContext:
    """One routing decision: the eligible engines, the prompt's block hashes, and what the filters and scorers
    share, each computed once (loads read the backends' state at `now`)."""

    def __init__(self, candidates: list[Backend], hashes: list[bytes], now: float, index: PrefixIndex | None,
                 model: str | None = None, tokens: list[int] | None = None, kv_index: KVIndex | None = None,
                 adapter: str | None = None):
        self.candidates = candidates
        self.hashes = hashes
        self.now = now
        self._index = index
        self.model = model  # the request's `model` (a LoRA adapter's name routes by residency)
        self.tokens = tokens  # the prompt's token ids (precise-prefix; kv_tokens.PromptTokens: with images), or None
        self._kv_index = kv_index
        self.adapter = adapter  # the LoRA adapter the request runs under (its blocks hash from its own root)
        self.precise = False  # `matched` came from the engines' KV events

    @cached_property
    def loads(self) -> dict[Backend, float]:
        return {b: b.load(self.now) for b in self.candidates}

    @cached_property
    def least_load(self) -> float:
        return min(self.loads.values())

    @cached_property
    def matched(self) -> dict[str, int]:
        """Engine URL -> leading blocks of the prompt it holds: per the engines' KV events where they report any
        (precise-prefix), else per the gateway's own routing history (empty without a prefix index)."""
        return {url: blocks for url, (blocks, _) in self.prefix.items()}

    @cached_property
    def prefix_worth(self) -> dict[str, float]:
        """Engine URL -> what its matched prefix saves: precise, each block at its copy's weight (the KV cache's
        above an offload tier's, kv_index.TIER_WEIGHTS); approximate, its blocks."""
        return {url: worth for url, (_, worth) in self.prefix.items()}

    @cached_property
    def prefix(self) -> dict[str, tuple[int, float]]:
        if self._kv_index is not None and self.tokens:
            precise = self._kv_index.scores([b.url for b in self.candidates], self.tokens, self.adapter)
            if precise:
                self.precise = True
                return precise
        approximate = self._index.matches(self.candidates, self.hashes) if self._index is not None else {}
        return {url: (n, float(n)) for url, n in approximate.items()}


# ---- the protocol -----------------------------------------------------------------------------------------------
class Filter(Protocol):
    def filter(self, ctx: RoutingContext, backends: list[Backend]) -> list[Backend]:
        """The engines of `backends` (in their order) that may take the request."""


class Scorer(Protocol):
    def score(self, ctx: RoutingContext, backends: list[Backend]) -> dict[Backend, float]:
        """A score in [0, 1] per engine; higher is better."""


class Picker(Protocol):
    def pick(self, backends: list[Backend], totals: list[float]) -> Backend:
        """One of `backends` given their weighted score totals (same order)."""


@dataclass
class Profile:
    decision: str  # what a pick counts as in the gateway's metrics ("cold" becomes "spill", see Router.pick)
    picker: Picker
    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)  # (scorer, weight)

    def choose(self, ctx: RoutingContext) -> Backend | None:
        backends = ctx.candidates
        for f in self.filters:
            backends = f.filter(ctx, backends)
            if not backends:
                return None
        totals = dict.fromkeys(backends, 0.0)
        for scorer, weight in self.scorers:
            for b, s in scorer.score(ctx, backends).items():
                totals[b] += weight * s
        return self.picker.pick(backends, list(totals.values()))


class Router:
    def __init__(self, name: str, profiles: list[Profile], index: PrefixIndex | None = None,
                 kv_index: KVIndex | None = None):
        if not profiles or profiles[-1].filters:
            raise ValueError("a router's last profile must have no filters, so every request finds an engine")
        self.name = name
        self.profiles = profiles
        self.index = index
        self.kv_index = kv_index  # precise-prefix: what the engines report holding

    def pick(self, candidates: list[Backend], hashes: list[bytes], now: float, model: str | None = None,
             tokens: list[int] | None = None, adapter: str | None = None) -> Pick:
        ctx = RoutingContext(candidates, hashes, now, self.index, model, tokens, self.kv_index, adapter)
        for profile in self.profiles:
            backend = profile.choose(ctx)
            if backend is not None:
                decision = profile.decision
                if decision == "cold" and ctx.matched:
                    decision = "spill"  # engines hold part of this prefix, but all of them are over the bound
                return Pick(backend, decision, ctx.matched.get(backend.url, 0), ctx.precise)
        raise AssertionError("unreachable: the last profile has no filters")

    def record(self, backend: Backend, hashes: list[bytes], now: float) -> None:
        if self.index is not None:
            self.index.record(backend, hashes, now)


# ---- filters ----------------------------------------------------------------------------------------------------
class BoundedLoad:
    """Two load bounds over all eligible engines: capacity, load + 1 <= ceil(load_factor * (total load + 1) /
    engines), and slack, load <= least load + slack. `both`: an engine must meet both, else either one."""

    def __init__(self, load_factor: float, slack: float, both: bool):
        self.load_factor = load_factor
        self.slack = slack
        self.both = both

    def filter(self, ctx: RoutingContext, backends: list[Backend]) -> list[Backend]:
        loads = ctx.loads
        capacity = math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(ctx.candidates))
        limit = ctx.least_load + self.slack
        if self.both:
            return [b for b in backends if loads[b] + 1 <= capacity and loads[b] <= limit]
        return [b for b in backends if loads[b] + 1 <= capacity or loads[b] <= limit]


class LongestPrefix:
    """The engines holding the longest matching chain of the prompt's blocks (none when nobody holds any); with
    the engines' tiers known (precise-prefix), the chain worth most: a block in the KV cache counts more than one
    in an offload tier."""

    def filter(self, ctx: RoutingContext, backends: list[Backend]) -> list[Backend]:
        worth = ctx.prefix_worth
        longest = max((worth.get(b.url, 0.0) for b in backends), default=0.0)
        return [b for b in backends if longest and worth.get(b.url, 0.0) == longest]


class LoRAResident:
    """The engines where the request's LoRA adapter is resident (none for base-model requests)."""

    def filter(self, ctx: RoutingContext, backends: list[Backend]) -> list[Backend]:
        return [b for b in backends if ctx.model and ctx.model in b.lora_resident]


# ---- scorers ----------------------------------------------------------------------------------------------------
class LoadScorer:
    """1 / (1 + load): 1 for an idle engine, falling as its load grows."""

    def score(self, ctx: RoutingContext, backends: list[Backend]) -> dict[Backend, float]:
        return {b: 1.0 / (1.0 + ctx.loads[b]) for b in backends}


class RendezvousScorer:
    """Rendezvous (highest random weight) hash of the prompt's first block and the engine URL: the same ranking of
    engines for the same prefix on every gateway replica, and a different one per prefix."""

    def score(self, ctx: RoutingContext, backends: list[Backend]) -> dict[Backend, float]:
        key = ctx.hashes[0] if ctx.hashes else b""
        return {b: int.from_bytes(hashlib.blake2b(key + b.url.encode(), digest_size=8).digest(), "big") / 2**64
                for b in backends}


class LoRAAffinityScorer:
    """For a request naming a LoRA adapter: 1 where the adapter is resident (loaded: no load latency, no eviction),
    0.5 where the engine has a free adapter place (it loads the adapter without evicting another), else 0 (and
    0.25 where an engine is known to serve adapters but its metrics are stale). With a weight above the load
    scorer's range (LORA_WEIGHT), residency comes first, free places second, load third. Requests for the base
    model (an engine's served name, from its metrics) score every engine alike. Residency comes from the engines'
    metrics, not from requests in flight, so an idle adapter that is loaded still counts (llm-d-router#2605)."""

    def score(self, ctx: RoutingContext, backends: list[Backend]) -> dict[Backend, float]:
        model = ctx.model
        if not model or any(model == b.served_model for b in ctx.candidates):
            return dict.fromkeys(backends, 0.0)  # the base model (or no name): every engine alike
        out = {}
        for b in backends:
            if model in b.lora_resident:
                out[b] = 1.0
            elif b.max_cpu_loras and len(b.lora_resident) < b.max_cpu_loras:
                out[b] = 0.5
            else:
                out[b] = 0.0
        return out


LORA_WEIGHT = 2.0  # residency levels (0.5 apart) x 2 >= 1, the whole range of the load and rendezvous scorers


# ---- pickers ----------------------------------------------------------------------------------------------------
class MaxScore:
    """The highest total; ties go to the first engine in order (every replica sees the same order)."""

    def pick(self, backends: list[Backend], totals: list[float]) -> Backend:
        return backends[totals.index(max(totals))]


class RotatingMaxScore:
    """The highest total; ties take turns."""

    def __init__(self):
        self._turn = itertools.count()

    def pick(self, backends: list[Backend], totals: list[float]) -> Backend:
        best = max(totals)
        ties = [b for b, t in zip(backends, totals) if t == best]
        return ties[next(self._turn) % len(ties)]


# ---- the routings -----------------------------------------------------------------------------------------------
def prefix_load(load_factor: float = 1.25, affinity_slack: float = 2.0, cold_slack: float = 1.0,
                index_size: int = 200_000, index: PrefixIndex | None = None) -> Router:
    if load_factor < 1.0:
        raise ValueError("load_factor must be >= 1")
    if affinity_slack < 0 or cold_slack < 0:
        raise ValueError("affinity_slack and cold_slack must be >= 0")
    return Router("prefix-load", [
        Profile("lora-affinity", MaxScore(), [LoRAResident(), BoundedLoad(load_factor, affinity_slack, both=False)],
                [(LoadScorer(), 1.0)]),
        Profile("affinity", MaxScore(), [BoundedLoad(load_factor, affinity_slack, both=False), LongestPrefix()],
                [(LoRAAffinityScorer(), LORA_WEIGHT), (LoadScorer(), 1.0)]),
        Profile("cold", MaxScore(), [BoundedLoad(load_factor, cold_slack, both=True)],
                [(LoRAAffinityScorer(), LORA_WEIGHT), (RendezvousScorer(), 1.0)]),
        Profile("cold", MaxScore(), [], [(LoRAAffinityScorer(), LORA_WEIGHT), (LoadScorer(), 1.0)]),
    ], index if index is not None else PrefixIndex(index_size))


def precise_prefix(load_factor: float = 1.25, affinity_slack: float = 2.0, cold_slack: float = 1.0,
                   index_size: int = 200_000, index: PrefixIndex | None = None,
                   kv_index: KVIndex | None = None) -> Router:
    router = prefix_load(load_factor, affinity_slack, cold_slack, index_size, index)
    router.name = "precise-prefix"
    router.kv_index = kv_index if kv_index is not None else KVIndex()
    return router


def least_load(**_options) -> Router:
    return Router("least-load", [Profile("least-load", RotatingMaxScore(), [],
                                         [(LoRAAffinityScorer(), LORA_WEIGHT), (LoadScorer(), 1.0)])])


def round_robin(**_options) -> Router:
    return Router("round-robin", [Profile("round-robin", RotatingMaxScore())])


ROUTERS = {"prefix-load": prefix_load, "precise-prefix": precise_prefix, "least-load": least_load,
           "round-robin": round_robin}
ROUTINGS = tuple(ROUTERS)


def make_router(name: str, load_factor: float = 1.25, affinity_slack: float = 2.0, cold_slack: float = 1.0,
                index_size: int = 200_000, index: PrefixIndex | None = None,
                kv_index: KVIndex | None = None) -> Router:
    """`index`: a prefix index shared by several routers (the shared gateway's pools: one bounded index for every
    model, whose hashes start with the model's name, instead of one per pool). `kv_index`: the pool's index of
    the engines' KV events (precise-prefix; one per pool, never shared between models)."""
    build = ROUTERS.get(name)
    if build is None:
        raise ValueError(f"unknown routing {name!r}; choose one of {', '.join(ROUTINGS)}")
    extra = {"index": index} if name in ("prefix-load", "precise-prefix") else {}
    if name == "precise-prefix":
        extra["kv_index"] = kv_index
    return build(load_factor=load_factor, affinity_slack=affinity_slack, cold_slack=cold_slack,
                 index_size=index_size, **extra)
