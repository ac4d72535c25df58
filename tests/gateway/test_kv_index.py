"""The gateway's view of the engines' KV caches: a real engine-side publisher (engine/core/kv_events.py, no model
needed) and a stand-in vLLM engine (the same ZMQ wire, vLLM's map encoding and its unrecomputable block hashes)
feeding the gateway's real ZMQ subscribers; a sequence gap or a restarted engine resets that engine's view instead
of leaving it stale; the precise scorer routes by what engines report, for both runtimes, and falls back without
events; gateway replicas fed the same events agree; an adapter's blocks never score for another request."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import msgpack
import pytest

from shoal.engine.config import KVEventsConfig
from shoal.engine.core.kv_events import KVEventPublisher
from shoal.engine.kv_hash import hash_chain, lora_root
from shoal.operator.gateway.backends import BackendSet
from shoal.operator.gateway.kv_index import KVIndex, decode_batch
from shoal.operator.gateway.kv_subscriber import KVSubscribers
from shoal.operator.gateway.routing import make_router

from .gwkit import free_port

URL = "http://127.0.0.1:8000"
BOUND = 20.0  # seconds a test waits for the subscriber to see what was published


def events_config(port: int, replay: int | None) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                          replay_endpoint=f"tcp://*:{replay}" if replay else None)


def publisher(port: int, replay: int | None) -> KVEventPublisher:
    return KVEventPublisher(events_config(port, replay), 16, "CPU")


class VLLMEngine(KVEventPublisher):
    """vLLM's side of the wire. Shoal's publisher already speaks vLLM's ZMQ protocol (PUB + replay ROUTER, 8-byte
    sequence numbers); this one sends what vLLM sends on it: EventBatch and events as maps (vLLM's msgspec structs,
    tagged under "type", no longer array-like), and block hashes made as vLLM makes them — sha256 of a random
    per-process seed, the parent, the block's tokens and its extra keys (adapter name; cache_salt on a chain's
    first block) — 32 bytes no other process can recompute."""

    def __init__(self, port: int, replay: int | None, block_size: int = 16):
        super().__init__(events_config(port, replay), block_size, "GPU")
        self.seed = os.urandom(32)

    def encode(self, ts: float, events: list, lora_names: dict) -> bytes:
        return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": self.dp_rank})

    def store(self, tokens: list[int], start: int = 0, end: int | None = None, lora: tuple[int, str] | None = None,
              salt: str | None = None) -> list[bytes]:
        """Cache full blocks start..end of `tokens` (one BlockStored, as vLLM's cache_full_blocks sends it; `lora`:
        (vLLM's adapter id, its name)); returns the hashes of every full block of `tokens`."""
        bs = self.block_size
        lora_id, lora_name = lora or (None, None)
        parent, hashes, keys = self.seed, [], []
        for i in range(len(tokens) // bs):
            extra = ([lora_name] if lora_name else []) + ([salt] if salt and i == 0 else [])
            parent = hashlib.sha256(parent + msgpack.packb([tokens[i * bs:(i + 1) * bs], extra])).digest()
            hashes.append(parent)
            keys.append(extra or None)
        end = len(hashes) if end is None else end
        self.publish([{"type": "BlockStored", "block_hashes": hashes[start:end],
                       "parent_block_hash": hashes[start - 1] if start else None,
                       "token_ids": tokens[start * bs:end * bs], "block_size": bs, "lora_id": lora_id,
                       "medium": "GPU", "lora_name": lora_name, "extra_keys": keys[start:end]}])
        return hashes

    def remove(self, hashes: list[bytes]) -> None:
        self.publish([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}])


def shoal_stored(tokens: list[int], lora_id: int | None = None, end: int | None = None) -> tuple:
    """A Shoal engine's BlockStored (its block pool's tuple) for the leading `end` blocks of `tokens`."""
    hashes = list(hash_chain(tokens, 16, parent=lora_root(lora_id)))[:end]
    return ("BlockStored", hashes, None, tokens[:16 * len(hashes)], lora_id)


class Replica:
    """One gateway replica's precise-prefix state for a pool: its own index, subscribers (their own ZMQ context,
    as in a process of their own) and router. `ports`: engine URL -> (events port, replay port or None)."""

    def __init__(self, ports: dict[str, tuple[int, int | None]]):
        self.backends = BackendSet()
        self.backends.replace(set(ports))
        self.index = KVIndex()
        self.subs = KVSubscribers(self.backends, self.index, 1, None, ports=ports)
        self.router = make_router("precise-prefix", kv_index=self.index)

    async def __aenter__(self) -> "Replica":
        self.subs.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.subs.close()

    def matches(self, tokens: list[int], adapter: str | None = None) -> dict[str, int]:
        return self.index.matches(sorted(self.index.views), tokens, adapter)

    def pick(self, tokens: list[int], adapter: str | None = None) -> tuple[str, int, bool]:
        p = self.router.pick(self.backends.eligible(), [], time.monotonic(), model=adapter, tokens=tokens,
                             adapter=adapter)
        return p.backend.url, p.matched_blocks, p.precise

    async def hear(self, engines: dict[str, KVEventPublisher]) -> None:
        """Until this replica applied every batch `engines` published so far. Empty batches are sent meanwhile:
        a PUB socket drops what precedes a subscription, and the first batch heard brings the rest by replay."""
        for url, pub in engines.items():
            deadline = time.monotonic() + BOUND
            seq, resend = pub.publish([]), time.monotonic() + 1.0
            while (view := self.index.views.get(url)) is None or view.last_seq != seq:
                assert time.monotonic() < deadline, f"timed out after {BOUND}s waiting for {url}'s events"
                if time.monotonic() > resend:
                    seq, resend = pub.publish([]), time.monotonic() + 1.0
                await asyncio.sleep(0.02)


def held(index: KVIndex, url: str = URL) -> set:
    """The block hashes `url` reported holding, as the index has them."""
    view = index.views.get(url)
    return set(view.reported) if view is not None else set()


def stored(*hashes: int) -> tuple:
    """Blocks whose reported hashes are not the gateway's (as a vLLM engine's are not)."""
    return ("BlockStored", list(hashes), None, [1] * 16 * len(hashes), None)


async def until(predicate, what: str, keep_publishing=None) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {BOUND}s waiting for {what}"
        if keep_publishing is not None:
            keep_publishing()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("replay", [True, False], ids=["with-replay", "no-replay"])
async def test_a_gap_or_a_restart_resets_the_engines_view(replay):
    port, replay_port = free_port(), (free_port() if replay else None)
    pub = publisher(port, replay_port)
    replica = Replica({URL: (port, replay_port)})
    index, backends, subs = replica.index, replica.backends, replica.subs
    subs.start()
    try:
        pub.publish([stored(1, 2, 3)])
        marker = iter(range(1000, 2000))
        # A PUB socket drops what it sends before the subscription arrives: with replay, the first batch heard
        # brings back the ones before it; without, the view starts at what was heard (a subset, never stale).
        await until(lambda: held(index) & ({1} | set(range(1000, 2000))), "the first batches",
                    lambda: pub.publish([stored(next(marker))]))
        if replay:
            await until(lambda: {1, 2, 3} <= held(index), "the replayed first batch")
        resets = index.views[URL].resets

        next(pub._seq)  # a batch lost on the way (the publisher's queue overflowed): its number never comes
        pub.publish([stored(7)])
        await until(lambda: 7 in held(index), "the batch after the gap")
        view = index.views[URL]
        assert view.resets > resets
        # Everything before the gap is forgotten: the lost batch may have removed any of it. A replay cannot
        # bring it back either (the buffer has the same hole).
        assert set(view.reported) == {7}, view.reported

        # The engine restarts: new numbers from 0, nothing of the old cache.
        pub.close()
        pub = publisher(port, replay_port)
        marker = iter(range(2000, 3000))
        await until(lambda: held(index) & set(range(2000, 3000)), "the restarted engine's events",
                    lambda: pub.publish([stored(next(marker))]))
        assert 7 not in held(index)

        pub.publish([("AllBlocksCleared",)])
        pub.publish([stored(42)])
        await until(lambda: 42 in held(index), "the batch after AllBlocksCleared")
        assert held(index) == {42}

        backends.replace(set())  # the engine left discovery: its subscriber and view go
        assert URL not in index.views and not subs.tasks
    finally:
        await subs.close()
        pub.close()


def test_decodes_both_of_vllms_encodings():
    import msgpack

    array = msgpack.packb([1.0, [["BlockStored", [5, 6], None, [1] * 32, 16, None, "GPU", None],
                                 ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]], 0])
    mapped = msgpack.packb({"ts": 1.0, "events": [
        {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None, "token_ids": [1] * 32,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}, {"type": "AllBlocksCleared"}]})
    expected = [("BlockStored", [5, 6], None, [1] * 32, 16, None, "GPU", None, None), ("BlockRemoved", [5], "GPU"),
                ("AllBlocksCleared",)]
    assert decode_batch(array) == expected
    assert decode_batch(mapped) == expected


def test_precise_scorer_prefers_the_engine_holding_the_longest_prefix():
    backends = BackendSet()
    backends.replace({"http://a:8000", "http://b:8000"})
    a, b = backends.all()
    tokens = list(range(1, 81))  # 5 blocks of 16
    chain = list(hash_chain(tokens, 16))
    index = KVIndex()
    index.apply(a.url, 0, [("BlockStored", chain[:2], None, tokens[:32], 16, None, "CPU", None)])
    index.apply(b.url, 0, [("BlockStored", chain[:4], None, tokens[:64], 16, None, "CPU", None)])
    router = make_router("precise-prefix", kv_index=index)
    now = time.monotonic()
    pick = router.pick([a, b], [], now, tokens=tokens)
    assert (pick.backend, pick.decision, pick.matched_blocks, pick.precise) == (b, "affinity", 4, True)
    # The same tokens under a LoRA adapter hash from another root: no engine holds them for an adapter request,
    # until one stores blocks under it — with its own adapter number (engines number adapters in load order).
    assert not index.matches([a.url, b.url], tokens, "sql")
    lora_chain = list(hash_chain(tokens, 16, parent=lora_root(3)))
    assert not set(lora_chain) & set(chain)
    index.apply(a.url, 1, [("BlockStored", lora_chain[:3], None, tokens[:48], 16, 3, "CPU", "sql")])
    assert index.matches([a.url, b.url], tokens, "sql") == {a.url: 3}
    assert index.matches([a.url, b.url], tokens) == {a.url: 2, b.url: 4}  # base-model requests: base blocks only
    pick = router.pick([a, b], [], now, model="sql", tokens=tokens, adapter="sql")
    assert (pick.backend, pick.matched_blocks, pick.precise) == (a, 3, True)
    # No events for this prompt: the approximate index (what the gateway routed) decides.
    router.record(a, [b"h1", b"h2"], now)
    pick = router.pick([a, b], [b"h1", b"h2"], now, tokens=[999] * 32)
    assert (pick.backend, pick.precise, pick.matched_blocks) == (a, False, 2)


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no tokenizer.json there"),
    (["--kv-events-endpoint", "http://127.0.0.1:8001"], "expected URL=PORT[,REPLAY_PORT]"),
    (["--kv-events-endpoint", "http://127.0.0.1:8001=5557,70000"], "expected URL=PORT[,REPLAY_PORT]"),
])
def test_bad_precise_prefix_flags_are_usage_errors(flags, message, capsys):
    from shoal.operator.gateway.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--routing", "precise-prefix", "--endpoint", "http://127.0.0.1:8001", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


SHOAL, VLLM = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def prompt(seed: int, blocks: int = 5) -> list[int]:
    return [seed * 1000 + i for i in range(16 * blocks)]


async def test_a_vllm_engine_is_indexed_by_the_gateways_own_hashes():
    """vLLM's hashes cannot be recomputed: the index maps each to its own hash of the block's token chain, so a
    prompt scores a vLLM engine as it scores a Shoal one, and BlockRemoved (vLLM's hashes only) removes it."""
    ports = {SHOAL: (free_port(), free_port()), VLLM: (free_port(), free_port())}
    shoal, vllm = publisher(*ports[SHOAL]), VLLMEngine(*ports[VLLM])
    engines = {SHOAL: shoal, VLLM: vllm}
    p, salted = prompt(1), prompt(2)
    try:
        async with Replica(ports) as gw:
            await gw.hear(engines)
            shoal.publish([shoal_stored(p, end=1)])
            hashes = vllm.store(p, 0, 2)
            vllm.store(p, 2, 5)  # chained to block 1 by its parent hash
            vllm.store(p, lora=(1, "sql"))
            vllm.store(salted, 0, 1, salt="tenant-a")  # hashed with a cache_salt: never the gateway's hash
            vllm.store(salted, 1, 3, salt="tenant-a")
            await gw.hear(engines)
            assert gw.matches(p) == {SHOAL: 1, VLLM: 5}
            assert gw.pick(p) == (VLLM, 5, True)
            assert gw.matches(p, "sql") == {VLLM: 5} and gw.matches(p, "chat") == {}
            assert gw.matches(salted) == {}

            vllm.store(p, 0, 2)  # a second copy of blocks 0-1 (vLLM does not deduplicate)
            vllm.remove([hashes[0], hashes[3]])
            await gw.hear(engines)
            assert gw.matches(p) == {SHOAL: 1, VLLM: 3}  # block 0's other copy holds; block 3 is gone
            vllm.remove([hashes[0]])
            await gw.hear(engines)
            assert gw.matches(p) == {SHOAL: 1}
            assert gw.pick(p) == (SHOAL, 1, True)

            vllm.store(p, 0, 5)
            await gw.hear(engines)
            assert gw.matches(p)[VLLM] == 5
            next(vllm._seq)  # a batch lost: the view resets, and the replay has the same hole
            q = prompt(3)
            vllm.store(q)
            vllm.store(p, 5, 5)  # nothing new, but chained to a block from before the gap
            await gw.hear(engines)
            assert gw.matches(p) == {SHOAL: 1} and gw.matches(q) == {VLLM: 5}
            assert gw.index.views[VLLM].resets >= 2
    finally:
        shoal.close()
        vllm.close()


def views(replica: Replica) -> dict[str, tuple]:
    return {url: (dict(v.blocks), dict(v.lora_roots), v.last_seq) for url, v in replica.index.views.items()}


async def test_gateway_replicas_fed_the_same_events_agree_even_when_one_joins_late():
    """Two replicas: one hears everything live, one joins late (everything by replay), and reconnects later; they
    hold the same views and pick alike. The Shoal engine restarts in between and numbers its adapters anew: the
    adapter a replica learned before the restart must not keep the number another adapter has now."""
    ports = {SHOAL: (free_port(), free_port()), VLLM: (free_port(), free_port())}
    shoal, vllm = publisher(*ports[SHOAL]), VLLMEngine(*ports[VLLM])
    engines = {SHOAL: shoal, VLLM: vllm}
    prompts = [prompt(i) for i in range(1, 5)]
    try:
        async with Replica(ports) as early:
            await early.hear(engines)
            shoal.publish([shoal_stored(prompts[0], 1, end=4)], {1: "sql"})
            shoal.publish([shoal_stored(prompts[1], end=2)])
            vllm.store(prompts[1], 0, 4)
            await early.hear(engines)
            assert early.matches(prompts[0], "sql") == {SHOAL: 4}

            shoal.close()  # the engine restarts: "chat" is its adapter 1 now, "sql" is not loaded
            resets = early.index.views[SHOAL].resets
            shoal = engines[SHOAL] = publisher(*ports[SHOAL])
            await until(lambda: early.index.views[SHOAL].resets > resets, "the restart to be noticed",
                        lambda: shoal.publish([]))
            shoal.publish([shoal_stored(prompts[0], 1, end=3)], {1: "chat"})
            shoal.publish([shoal_stored(prompts[2], end=5)])
            hashes = vllm.store(prompts[3], 0, 3)
            vllm.remove(hashes[2:3])
            await early.hear(engines)

            async with Replica(ports) as late:
                await late.hear(engines)
                await early.hear(engines)
                for replica in (early, late):
                    assert replica.matches(prompts[0], "sql") == {}  # chat's blocks are not sql's
                    assert replica.matches(prompts[0], "chat") == {SHOAL: 3}
                assert views(early) == views(late)
                for tokens in prompts:
                    for adapter in (None, "sql", "chat"):
                        assert early.pick(tokens, adapter) == late.pick(tokens, adapter), (tokens[0], adapter)
                assert early.pick(prompts[1]) == (VLLM, 4, True)
                assert early.pick(prompts[2]) == (SHOAL, 5, True)

            vllm.store(prompts[0], 0, 5)
            shoal.publish([("AllBlocksCleared",)])
            async with Replica(ports) as reconnected:  # the late replica again, after more events
                await reconnected.hear(engines)
                await early.hear(engines)
                assert views(early) == views(reconnected)
                assert early.pick(prompts[0]) == reconnected.pick(prompts[0]) == (VLLM, 5, True)
    finally:
        shoal.close()
        vllm.close()


@pytest.mark.parametrize("encoding", ["vllm-int", "vllm-bytes", "vllm-name-only", "shoal"])
def test_an_adapters_blocks_never_score_for_the_base_model_or_another_adapter(encoding):
    """Whatever an engine reports about an adapter (vLLM's int or 32-byte hashes, a name without vLLM's
    deprecated lora_id, Shoal's own hashes), its blocks match requests for that adapter on that engine only."""
    tokens = prompt(7, blocks=3)
    chain = list(hash_chain(tokens, 16, parent=lora_root(2)))
    reported = {"vllm-int": [11, 12, 13], "vllm-bytes": [bytes([i]) * 32 for i in (11, 12, 13)],
                "vllm-name-only": [11, 12, 13], "shoal": chain}[encoding]
    lora_id = None if encoding == "vllm-name-only" else 2
    extra = None if encoding == "shoal" else [["sql"]] * 3
    index = KVIndex()
    index.apply(VLLM, 0, [("BlockStored", reported, None, tokens, 16, lora_id, "GPU", "sql", extra)])
    index.apply(SHOAL, 0, [("BlockStored", list(hash_chain(tokens, 16)), None, tokens, 16, None, "GPU", None)])
    assert index.matches([SHOAL, VLLM], tokens) == {SHOAL: 3}  # base-model blocks only
    assert index.matches([SHOAL, VLLM], tokens, "chat") == {}
    assert index.matches([SHOAL, VLLM], tokens, "sql") == {VLLM: 3}
    index.apply(VLLM, 1, [("BlockRemoved", reported[1:2], "GPU")])
    assert index.matches([SHOAL, VLLM], tokens, "sql") == {VLLM: 1}


async def test_a_request_with_a_cache_salt_never_routes_by_the_index():
    """vLLM keeps a salted prompt's blocks apart (a tenant's own); the index holds none of them, so a salted
    request must not be matched against anyone's unsalted blocks."""
    from shoal.operator.gateway.proxy import Gateway, GatewayConfig

    gw = Gateway(GatewayConfig(routing="precise-prefix"))
    body = {"model": "m", "prompt": list(range(64))}
    assert await gw.prompt_tokens("/v1/completions", body, "m", gw.pools.pool) == list(range(64))
    assert await gw.prompt_tokens("/v1/completions", {**body, "cache_salt": "a"}, "m", gw.pools.pool) is None


async def test_a_block_an_offload_tier_keeps_stays_routable_until_the_tier_lets_it_go(llama_model):
    """A real engine (a pool too small for the workload, tests/offloadkit.py, behind a CPU tier of 30 blocks)
    publishing to the gateway's real subscriber: a prompt whose blocks left the pool for the tier is still matched,
    all of it, at the tier's weight, and the engine does serve it from there; once the tier has pushed it out the
    gateway holds none of it; a reset clears the view; a gap resets it."""
    from offloadkit import POOL, generate_settled, gib, prompts

    from shoal.engine import LLM
    from shoal.operator.gateway.kv_index import TIER_WEIGHTS

    port = free_port()
    with LLM(model=llama_model, **POOL) as probe:
        per_block = probe.llm_engine.executor.bytes_per_block(POOL["block_size"])
    llm = LLM(model=llama_model, **POOL, kv_offloading_size=gib(30, per_block),
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    engine = llm.llm_engine

    def run(tokens: list[int]):
        out = generate_settled(llm, tokens)
        engine.publish_kv_events()  # what the copy thread did since the step (the idle engine loop's call)
        return out

    a, *others = prompts(8, seed=3)
    blocks = len(a) // POOL["block_size"]
    try:
        async with Replica({URL: (port, None)}) as gw:
            gw.index.max_blocks = blocks  # the prompt's own blocks (a reply's would follow)
            await gw.hear({URL: engine.kv_events})
            run(a)
            await gw.hear({URL: engine.kv_events})
            assert gw.index.scores([URL], a) == {URL: (blocks, blocks * 1.0)}  # in the KV cache

            run(others[0])
            run(others[1])  # a's blocks are out of the pool now, in the CPU tier
            await gw.hear({URL: engine.kv_events})
            assert not set(hash_chain(a, POOL["block_size"])) & set(engine.pool._cached)
            assert gw.index.scores([URL], a) == {URL: (blocks, pytest.approx(blocks * TIER_WEIGHTS["CPU_OFFLOAD"]))}
            assert gw.pick(a) == (URL, blocks, True)

            for p in others[2:]:  # 6 more prompts' evictions push a out of the 30-block tier
                run(p)
            await gw.hear({URL: engine.kv_events})
            assert engine.executor.offload.lookup(list(hash_chain(a, POOL["block_size"]))) == []
            assert gw.matches(a) == {}

            again = run(others[-3])  # out of the pool, still in the tier: served from it, and held again
            assert again.num_cached_tokens > 0 and engine.tiers.hits["cpu"] > 0
            await gw.hear({URL: engine.kv_events})
            assert gw.matches(others[-3])[URL] == blocks
            assert llm.reset_prefix_cache()
            await gw.hear({URL: engine.kv_events})
            assert gw.index.views[URL].blocks == {}

            run(others[-1])
            await gw.hear({URL: engine.kv_events})
            assert gw.matches(others[-1]) == {URL: blocks}
            resets = gw.index.views[URL].resets
            next(engine.kv_events._seq)  # a batch lost on the way
            run(a)
            await gw.hear({URL: engine.kv_events})
            assert gw.index.views[URL].resets > resets
            assert gw.matches(others[-1]) == {}, "a view kept blocks from before a gap"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("runtime", ["vllm", "shoal-gpu", "shoal-cpu"])
def test_the_precise_scorer_ranks_the_kv_cache_above_the_cpu_tier_above_the_disk(runtime):
    """Three engines holding the same 4 leading blocks, one in its KV cache, one in its CPU tier, one on disk, as
    each runtime names the media (vLLM: GPU / CPU; Shoal: GPU or a CPU engine's CPU / its tiers'): the KV cache
    wins, then the CPU tier, then the disk; a tier holding clearly more of the prompt beats a shorter cached run."""
    device, cpu = {"vllm": ("GPU", "CPU"), "shoal-gpu": ("GPU", "CPU"), "shoal-cpu": ("CPU", "CPU_OFFLOAD")}[runtime]
    tokens = list(range(1, 16 * 8 + 1))
    chain = list(hash_chain(tokens, 16))
    backends = BackendSet()
    backends.replace({"http://a:8000", "http://b:8000", "http://c:8000"})
    a, b, c = backends.all()
    index = KVIndex()
    for backend in (a, b, c):  # each computes the blocks in its KV cache first
        index.apply(backend.url, 0, [("BlockStored", chain[:4], None, tokens[:64], 16, None, device, None)])
    # b's and c's leave the KV cache for a tier (vLLM copies to the CPU tier while the block is still cached)
    index.apply(b.url, 1, [("BlockStored", chain[:4], None, [], 16, None, cpu, None),
                           ("BlockRemoved", chain[:4], device)])
    index.apply(c.url, 1, [("BlockRemoved", chain[:4], device), ("BlockStored", chain[:4], None, [], 16, None, cpu,
                                                                   None),
                           ("BlockRemoved", chain[:4], cpu), ("BlockStored", chain[:4], None, [], 16, None, "DISK",
                                                                  None)])
    router = make_router("precise-prefix", kv_index=index)
    now = time.monotonic()
    assert index.matches([a.url, b.url, c.url], tokens) == {a.url: 4, b.url: 4, c.url: 4}
    worth = {url: w for url, (_, w) in index.scores([a.url, b.url, c.url], tokens).items()}
    assert worth[a.url] > worth[b.url] > worth[c.url] > 0, worth
    assert router.pick([c, b, a], [], now, tokens=tokens).backend is a
    assert router.pick([c, b], [], now, tokens=tokens).backend is b
    # c's disk tier lets the blocks go: c holds none of them any more
    index.apply(c.url, 2, [("BlockRemoved", chain[:4], "DISK")])
    assert c.url not in index.matches([a.url, b.url, c.url], tokens)
    # b's CPU tier gets the whole prompt (8 blocks, 6.4) and beats a's 4 in the KV cache
    index.apply(b.url, 2, [("BlockStored", chain[4:], chain[3], tokens[64:], 16, None, device, None),
                           ("BlockRemoved", chain[4:], device),
                           ("BlockStored", chain[4:], None, [], 16, None, cpu, None)])
    assert index.matches([a.url, b.url], tokens) == {a.url: 4, b.url: 8}
    assert router.pick([a, b], [], now, tokens=tokens).backend is b


def image_events(tokens: list[int], digest: bytes, offset: int, length: int) -> list[tuple]:
    """A Shoal engine's events (its block pool, block size 4, through its publisher's wire) for a prompt holding
    one image at `offset` with content digest `digest`."""
    from shoal.engine.core.images import ProcessedImage, PromptImages
    from shoal.engine.core.kv_cache import BlockPool

    pool = BlockPool(64, 4, events=True)
    images = PromptImages([(offset, ProcessedImage(None, length, digest))], 4)
    ids, chain = pool.allocate(len(tokens) // 4 + 1), []
    pool.cache_full_blocks(tokens, ids, chain, len(tokens), None, images.block_key)
    pub = KVEventPublisher.__new__(KVEventPublisher)  # only its encoder: no sockets
    pub.block_size, pub.medium, pub.dp_rank = 4, "GPU", 0
    return decode_batch(pub.encode(0.0, pool.take_events(), {}))


def test_image_blocks_match_the_engine_holding_that_image_and_not_another():
    # Two engines hold the same conversation turn about different images. The request's prompt carries its image's
    # placement and digest (as /tokenize answers them): the engine holding that image matches every block, the other
    # only the text before the image, and the next turn of the conversation routes to the first engine.
    from shoal.operator.gateway.kv_tokens import PromptTokens, tokenized_images

    x, y = hashlib.sha256(b"x").digest(), hashlib.sha256(b"y").digest()
    turn = [1, 2, 3, 4, 5, 6] + [9] * 10 + list(range(20, 36))  # the image: tokens 6..15 (blocks 1-3 of 8)
    a, b = "http://a:8000", "http://b:8000"
    index = KVIndex()
    index.apply(a, 0, image_events(turn, x, 6, 10))
    index.apply(b, 0, image_events(turn, y, 6, 10))
    assert index.views[a].native and len(index.views[a].blocks) == 8  # every image block hashed, and after it

    with_x = PromptTokens(turn, tokenized_images([{"offset": 6, "length": 10, "digest": x.hex()}]))
    assert index.matches([a, b], with_x) == {a: 8, b: 1}
    with_y = PromptTokens(turn, [(6, 10, y)])
    assert index.matches([a, b], with_y) == {a: 1, b: 8}
    assert index.matches([a, b], turn) == {a: 1, b: 1}  # the same text without its image: only the text before it
    other = PromptTokens(turn, [(6, 10, hashlib.sha256(b"z").digest())])
    assert index.matches([a, b], other) == {a: 1, b: 1}

    next_turn = PromptTokens(turn + list(range(40, 52)), [(6, 10, x)])
    backends = BackendSet()
    backends.replace({a, b})
    router = make_router("precise-prefix", kv_index=index)
    p = router.pick(backends.eligible(), [], time.monotonic(), tokens=next_turn)
    assert (p.backend.url, p.matched_blocks, p.precise) == (a, 8, True)

    # /tokenize answers the gateway does not trust leave the prompt text-only (no image block can match)
    for bad in (None, [{"offset": 6, "length": 10}], [{"offset": 6, "length": 10, "digest": "zz"}],
                [{"offset": -1, "length": 10, "digest": x.hex()}], [{"offset": 6, "length": 10, "digest": "ab"}]):
        assert tokenized_images(bad) == []


def test_a_vllm_engines_multimodal_blocks_stay_unmatched():
    # vLLM's extra keys are its own multimodal identifiers: from an engine whose hashes are not the gateway's, a
    # block keyed by them is left out (with its descendants), even when the identifier looks like a digest
    index = KVIndex()
    text = list(range(1, 17))
    image = [9] * 16
    index.apply(URL, 0, [("BlockStored", [b"t" * 32], None, text, 16, None, "GPU", None, None),
                         ("BlockStored", [b"i" * 32, b"j" * 32], b"t" * 32, image + text, 16, None, "GPU", None,
                          [["ab" * 32], None])])
    assert index.views[URL].native is False and held(index) == {b"t" * 32}
    from shoal.operator.gateway.kv_tokens import PromptTokens

    assert index.matches([URL], PromptTokens(text + image + text, [(16, 16, bytes.fromhex("ab" * 32))])) == {URL: 1}
