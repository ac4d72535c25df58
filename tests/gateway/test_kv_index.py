"""The gateway's view of the engines' KV caches: a real engine-side publisher (engine/core/kv_events.py, no model
needed) feeding the gateway's real ZMQ subscriber; a sequence gap or a restarted engine resets that engine's view
instead of leaving it stale; the precise scorer routes by what engines report and falls back without events."""

from __future__ import annotations

import asyncio
import time

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


def publisher(port: int, replay: int | None) -> KVEventPublisher:
    return KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                                           replay_endpoint=f"tcp://*:{replay}" if replay else None), 16, "CPU")


def held(index: KVIndex) -> set:
    view = index.views.get(URL)
    return set(view.blocks) if view is not None else set()


def stored(*hashes: int) -> tuple:
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
    index = KVIndex()
    backends = BackendSet()
    backends.replace({URL})
    subs = KVSubscribers(backends, index, port, replay_port)
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
        assert set(view.blocks) == {7}, view.blocks

        # The engine restarts: new numbers from 0, nothing of the old cache.
        pub.close()
        pub = publisher(port, replay_port)
        marker = iter(range(2000, 3000))
        await until(lambda: held(index) & set(range(2000, 3000)), "the restarted engine's events",
                    lambda: pub.publish([stored(next(marker))]))
        assert 7 not in index.views[URL].blocks

        pub.publish([("AllBlocksCleared",)])
        pub.publish([stored(42)])
        await until(lambda: 42 in held(index), "the batch after AllBlocksCleared")
        assert set(index.views[URL].blocks) == {42}

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
    expected = [("BlockStored", [5, 6], None, [1] * 32, 16, None, "GPU", None), ("BlockRemoved", [5], "GPU"),
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
