"""KV events from a real engine over a real ZMQ SUB socket: BlockStored with the hashes a router computes from the
same tokens (shoal.engine.kv_hash), BlockRemoved on eviction, AllBlocksCleared on reset_prefix_cache, in order and
with consecutive sequence numbers; the replay socket answers the same batches. With offload tiers, the blocks a
tier keeps are announced in its medium and dropped from it when it lets them go."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from shoal.engine import LLM, SamplingParams
from shoal.engine.kv_hash import hash_chain

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    def __init__(self, port: int, topic: bytes):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.topic = topic
        self.batches: list[tuple[int, list]] = []  # (seq, events)
        self.payloads: dict[int, bytes] = {}

    def drain(self, timeout: float) -> None:
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp_rank == 0
            self.batches.append((int.from_bytes(seq, "big"), events))
            self.payloads[int.from_bytes(seq, "big")] = payload
            timeout = 0.2  # after the first message, only what is already on its way

    def events(self) -> list:
        return [e for _, events in self.batches for e in events]


@pytest.fixture()
def engine_with_events(llama_model):
    port, replay = free_port(), free_port()
    llm = LLM(llama_model, dtype="float32", block_size=BLOCK, num_kv_blocks=8, max_model_len=128,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}",
                                "topic": "kv@test"})
    sub = Subscriber(port, b"kv@test")
    try:
        yield llm, sub, replay
    finally:
        sub.ctx.destroy(linger=0)
        llm.shutdown()


def generate(llm: LLM, tokens: list[int]) -> None:
    llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0.0))


def subscribed(llm: LLM, sub: Subscriber, block_size: int = BLOCK) -> int:
    """Until `sub` hears the engine, then from a clean cache; the first sequence number heard. A PUB socket drops
    what it sends before a subscription reaches it: throwaway one-block prompts go first."""
    deadline = time.monotonic() + 20
    probe = 0
    while not sub.batches:
        assert time.monotonic() < deadline, "no KV event reached the subscriber within 20 s"
        generate(llm, [300 + probe % 50] * block_size)
        probe += 1
        sub.drain(0.2)
    assert llm.reset_prefix_cache()
    sub.drain(5)
    assert sub.events()[-1] == ["AllBlocksCleared"]
    first_seq = sub.batches[0][0]
    sub.batches.clear()
    return first_seq


def test_events_stream_in_order_with_the_routers_hashes(engine_with_events):
    llm, sub, replay_port = engine_with_events
    first_seq = subscribed(llm, sub)

    prompt = [(7 * i + 3) % 200 + 1 for i in range(3 * BLOCK + 2)]  # 3 full blocks and 2 tokens
    generate(llm, prompt)
    other = [(11 * i + 5) % 200 + 1 for i in range(6 * BLOCK + 4)]  # needs 7 of the 8 blocks: evicts the first
    generate(llm, other)
    assert llm.reset_prefix_cache()
    sub.drain(5)

    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"sequence numbers not consecutive: {seqs}"
    assert seqs[0] > first_seq
    events = sub.events()
    stored = [e for e in events if e[0] == "BlockStored"]
    expected = list(hash_chain(prompt, BLOCK))
    assert len(expected) == 3
    first = stored[0]
    assert first[1] == expected, "BlockStored hashes differ from kv_hash.hash_chain of the same tokens"
    assert first[2] is None  # the chain's first block has no parent
    assert first[3] == prompt[:3 * BLOCK]
    assert first[4:7] == [BLOCK, None, "CPU"]
    assert [e for e in stored if e[1][0] in expected[1:]] == [], "a block was announced twice"
    second = stored[1]
    assert second[1] == list(hash_chain(other, BLOCK))[:len(second[1])] and second[2] is None

    removed_at = next(i for i, e in enumerate(events) if e[0] == "BlockRemoved")
    removed = events[removed_at]
    assert removed[2] == "CPU" and removed[1] and set(removed[1]) <= set(expected), removed
    assert events.index(first) < removed_at < len(events) - 1
    assert events[-1] == ["AllBlocksCleared"]

    # The replay socket answers the same batches, from any sequence number on, then -1.
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = {}
        while True:
            assert dealer.poll(10_000), "no replay answer within 10 s"
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                break
            replayed[seq] = payload
        assert replayed == {s: sub.payloads[s] for s in seqs}
    finally:
        ctx.destroy(linger=0)


def test_events_need_prefix_caching(llama_model):
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(llama_model, dtype="float32", enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"})


def test_lora_blocks_carry_the_adapter_and_hash_from_its_root(llama_model, tmp_path):
    """A prompt run under a LoRA adapter is announced with the engine's adapter id and name, and its hashes are
    the chain from kv_hash.lora_root(id): never the base model's for the same tokens."""
    from shoal.engine.kv_hash import lora_root
    from shoal.engine.tools.tiny_lora import make_lora_adapter

    adapter = make_lora_adapter(tmp_path / "sql", llama_model, rank=4, alpha=8, seed=1)
    port = free_port()
    llm = LLM(llama_model, dtype="float32", block_size=BLOCK, max_model_len=128, enable_lora=True,
              lora_modules=[f"sql={adapter}"], max_lora_rank=8,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    sub = Subscriber(port, b"")
    try:
        prompt = [(5 * i + 2) % 200 + 1 for i in range(2 * BLOCK + 1)]
        base = list(hash_chain(prompt, BLOCK))

        def announced():
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False,
                         lora_request="sql")
            sub.drain(0.3)
            return [e for e in sub.events() if e[0] == "BlockStored" and e[5] is not None]

        deadline = time.monotonic() + 20
        while not (stored := announced()):
            assert time.monotonic() < deadline, "no BlockStored under the adapter within 20 s"
            llm.reset_prefix_cache()  # so the next run stores (and announces) its blocks again
        event = stored[0]
        lora_id = event[5]
        assert event[7] == "sql"
        assert event[1] == list(hash_chain(prompt, BLOCK, parent=lora_root(lora_id)))
        assert not set(event[1]) & set(base)
    finally:
        sub.ctx.destroy(linger=0)
        llm.shutdown()


def test_offload_tiers_announce_what_they_keep_and_drop(llama_model, tmp_path):
    """A pool too small for the workload (tests/offloadkit.py) behind a CPU tier of 6 blocks and a disk tier of 16:
    the events, replayed per medium, hold exactly what the pool and each tier hold; a block enters a tier only
    after leaving the one before it (the pool's BlockRemoved first, vLLM's per-medium index never sees it twice);
    the disk tier's overflow is removed; a reset clears everything and the tiers announce nothing after it."""
    from offloadkit import POOL, generate_settled, gib, prompts

    port = free_port()
    per_block = None
    with LLM(model=llama_model, **POOL, kv_events_config={"enable_kv_cache_events": True,
                                                          "endpoint": f"tcp://*:{port}"}) as probe:
        per_block = probe.llm_engine.executor.bytes_per_block(POOL["block_size"])
    llm = LLM(model=llama_model, **POOL, kv_offloading_size=gib(6, per_block), kv_offloading_disk_path=str(tmp_path),
              kv_offloading_disk_size=gib(16, per_block),
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    sub = Subscriber(port, b"")
    try:
        subscribed(llm, sub, POOL["block_size"])
        engine = llm.llm_engine
        for p in prompts(4) + prompts(2):  # each evicts the ones before; the last two come back from the tiers
            generate_settled(llm, p)
            engine.publish_kv_events()  # the copy thread's changes since the step (the idle loop's call)
        sub.drain(5)

        from shoal.engine.core.kv_events import tier_media

        device = engine.kv_events.medium  # the pool's: CPU here, GPU on CUDA
        cpu, disk = tier_media(device)["cpu"], tier_media(device)["disk"]
        assert len({device, cpu, disk}) == 3
        held: dict[str, dict[int, int]] = {device: {}, cpu: {}, disk: {}}
        left: dict[str, set] = {m: set() for m in held}  # hashes each medium has let go of
        for e in sub.events():
            if e[0] == "BlockStored":
                medium = e[6]
                for h in e[1]:
                    assert h not in held[medium], f"{h:x} announced twice in {medium}"
                    if medium == cpu:
                        assert h in left[device], f"{h:x} entered the CPU tier before it left the pool"
                        assert e[2] is None and e[3] == [] and e[4] == POOL["block_size"]
                    if medium == disk:
                        assert h in left[cpu], f"{h:x} reached the disk before it left the CPU tier"
                    held[medium][h] = 1
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    assert held[e[2]].pop(h, None), f"{h:x} removed from {e[2]}, which did not hold it"
                    left[e[2]].add(h)
        tiers = engine.executor.offload.tiers
        assert set(held[device]) == set(engine.pool._cached)
        assert set(held[cpu]) == set(tiers[0]._blocks) and len(held[cpu]) == 6
        assert set(held[disk]) == set(tiers[1]._blocks) and len(held[disk]) == 16
        assert left[disk], "the disk tier never let a block go"
        assert engine.tiers.hits["cpu"] + engine.tiers.hits["disk"] > 0, "no prefix came back from a tier"

        sub.batches.clear()
        assert llm.reset_prefix_cache()
        generate_settled(llm, prompts(1, seed=9)[0])  # nothing evicted: no tier event
        engine.publish_kv_events()
        sub.drain(5)
        events = sub.events()
        assert events[0] == ["AllBlocksCleared"], events[:2]
        assert all(e[0] == "BlockStored" and e[6] == device for e in events[1:]), events
    finally:
        sub.ctx.destroy(linger=0)
        llm.shutdown()
