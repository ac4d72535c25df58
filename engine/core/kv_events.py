"""KV events: what the prefix cache stored and dropped, published in vLLM's KV-events wire format, so a KV-cache
index outside the engine (Shoal's gateway, llm-d's KV-cache manager, Dynamo's router) knows which engine holds
which prefix.

The wire (vLLM's, `--kv-events-config`):
- a ZMQ PUB socket at `endpoint` (bound when the address has `*`, `::`, ipc:// or inproc://, else connected) sends
  one multipart message per engine step that changed the cache: (topic, sequence number as 8 bytes big-endian,
  payload). The sequence numbers count 0, 1, 2, ... from the engine's start: a subscriber that sees one missing
  lost events (or the engine restarted, when they start again from 0) and must rebuild its view.
- the payload is msgpack of an EventBatch, array-like: [ts, [event, ...], data_parallel_rank]; each event is a
  tagged array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name(, extra_keys)], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. Block hashes are unsigned
  64-bit integers (shoal.engine.kv_hash defines them); parent_block_hash is None for a chain's first block.
  extra_keys (vLLM's ninth field, omitted as vLLM omits its default when every block is text) is sent when a block
  holds image tokens: per block, the hex digests of its images (kv_hash.event_extra_keys), or None.
- an optional ROUTER socket at `replay_endpoint` answers a request [empty frame, start sequence as 8 bytes
  big-endian] with every buffered batch from that sequence on as [empty, seq, payload] and then [empty, -1 as 8
  signed bytes, b""] (the last `buffer_steps` batches are kept).

Publishing never stalls a step: the engine loop puts a step's events on a bounded queue (its sequence number
taken then) and a background thread encodes and sends them. When the queue is full the batch is dropped; its
sequence number is never sent, and that gap tells subscribers to resynchronise.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from shoal.engine.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def tier_media(device_medium: str) -> dict[str, str]:
    """The `medium` of each offload tier's events (core/kv_tiers.py): "CPU" for the host-memory tier, as vLLM's CPU
    offloading names it, except on a CPU engine, whose pool is "CPU" already: there "CPU_OFFLOAD"; "DISK" for
    the disk tier."""
    return {"cpu": "CPU_OFFLOAD" if device_medium == "CPU" else "CPU", "disk": "DISK"}


def wire_event(event: tuple, block_size: int, medium: str, lora_names: dict[int, str]) -> list:
    """A kv_cache event tuple as vLLM's array-like tagged struct; `medium` unless the tuple names its own (an
    offload tier's event, kv_tiers.py)."""
    kind = event[0]
    if kind == "BlockStored":
        _, hashes, parent, tokens, lora_id, *rest = event
        out = [kind, hashes, parent, tokens, block_size, lora_id, rest[0] if rest and rest[0] else medium,
               None if lora_id is None else lora_names.get(lora_id)]
        if len(rest) > 1 and rest[1] is not None:
            out.append(rest[1])  # extra_keys: only with image blocks (vLLM omits the default, so text is unchanged)
        return out
    if kind == "BlockRemoved":
        return [kind, event[1], event[2] if len(event) > 2 else medium]
    return [kind]


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard or local address is bound (stable side), any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int, medium: str, data_parallel_rank: int = 0):
        self.config, self.block_size, self.medium, self.dp_rank = config, block_size, medium, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._topic = config.topic.encode()
        self.dropped = 0  # batches lost to a full queue (their sequence numbers are gaps on the wire)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: "
                             f"{e}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s, topic %r)", config.endpoint,
                    config.replay_endpoint or "off", config.topic)

    def publish(self, events: list[tuple], lora_names: dict[int, str] | None = None) -> int:
        """Queue one step's events (the engine loop's call: never blocks); returns the batch's sequence number."""
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events, lora_names or {}))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: the queue is full (%d batches); dropped %d batches so far — "
                               "subscribers see the gap and resynchronise", self.config.max_queue_size, self.dropped)
        return seq

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            seq, ts, events, lora_names = item
            try:
                payload = self.encode(ts, events, lora_names)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not end publishing; the gap says it was lost
                logger.exception("KV events: could not publish batch %d", seq)

    def encode(self, ts: float, events: list[tuple], lora_names: dict[int, str]) -> bytes:
        """One batch's payload: an EventBatch, array-like."""
        return msgpack.packb([ts, [wire_event(e, self.block_size, self.medium, lora_names) for e in events],
                              self.dp_rank])

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignored a replay request of %d frames (expected 3)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)
