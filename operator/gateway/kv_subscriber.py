"""One ZMQ subscriber per engine of a pool, feeding its KV events into the pool's KVIndex (kv_index.py).

An engine at http://IP:PORT publishes on tcp://IP:<events port> and answers replays on tcp://IP:<replay port>
(the operator renders both, render/; the shared gateway reads each engine's from its EndpointSlice and follows
only the engines that publish). The subscriber follows the pool's engine set (BackendSet listeners): an
engine that appears gets a subscriber, one that leaves loses it and its view. A batch is applied only when its
sequence number follows the last one applied; otherwise — a gap (lost messages, a dropped connection) or a
restarted engine (numbers from 0 again) — the engine's view is reset and rebuilt from the replay socket's buffer
(from sequence 0, so an engine whose whole history is buffered is known completely), or from the live stream on
when the engine has no replay socket. A disconnect resets the view at once.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from shoal.operator.gateway.backends import BackendSet
from shoal.operator.gateway.kv_index import KVIndex, decode_batch

log = logging.getLogger("shoal.gateway.kv")

END_SEQ = -1
REPLAY_TIMEOUT = 2.0  # seconds a replay may take to start answering, and between its messages


class KVSubscribers:
    def __init__(self, backends: BackendSet, index: KVIndex, port: int | None, replay_port: int | None,
                 topic: str = "", ports: dict[str, tuple[int, int | None]] | None = None):
        """`ports`: engine URL -> (events port, replay port or None) where an engine's differ from the rule
        (static --endpoint engines sharing one host). `port` None: no rule, only the engines `ports` names are
        followed (the shared gateway: the ones whose EndpointSlice names KV-event ports, set_ports)."""
        self.backends, self.index = backends, index
        self.port, self.replay_port, self.topic = port, replay_port, topic.encode()
        self.ports = ports or {}
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}
        self._following: dict[str, tuple[int, int | None]] = {}  # the ports each task reads
        self._started = False

    def start(self) -> None:
        self._started = True
        self.backends.listeners.append(self.sync)
        self.sync()

    def set_ports(self, ports: dict[str, tuple[int, int | None]]) -> None:
        """Where each engine publishes (the shared gateway: from its EndpointSlices); an engine whose ports
        changed is subscribed to anew, with a fresh view."""
        self.ports = dict(ports)
        self.sync()

    def _ports_of(self, url: str) -> tuple[int, int | None] | None:
        if url in self.ports:
            return self.ports[url]
        return (self.port, self.replay_port) if self.port else None

    def sync(self) -> None:
        """Subscribers for exactly the pool's engines that publish (a BackendSet listener: called on every
        change)."""
        if not self._started:
            return
        wanted = {b.url: ports for b in self.backends.all() if (ports := self._ports_of(b.url)) is not None}
        for url in list(self.tasks):
            if wanted.get(url) != self._following.get(url):
                self.tasks.pop(url).cancel()
                self._following.pop(url, None)
                self.index.drop(url)
        for url in wanted.keys() - self.tasks.keys():
            self._following[url] = wanted[url]
            self.tasks[url] = asyncio.get_running_loop().create_task(self._follow(url), name=f"kv-events {url}")

    async def close(self) -> None:
        self._started = False
        if self.sync in self.backends.listeners:
            self.backends.listeners.remove(self.sync)
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        self._following.clear()
        self.ctx.destroy(linger=0)

    # ---- one engine --------------------------------------------------------------------------------------------
    async def _follow(self, url: str) -> None:
        host = urlsplit(url).hostname
        if host and ":" in host:
            host = f"[{host}]"
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        port, replay_port = self._following[url]
        sub.connect(f"tcp://{host}:{port}")
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self.index.reset(url, "subscribed")
        duplicates: dict[int, bytes] = {}  # batches a replay applied that the live stream may still deliver
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    self.index.reset(url, "connection lost")
                    duplicates.clear()
                if sub not in ready:
                    continue
                topic, seq_bytes, payload = await sub.recv_multipart()
                if self.topic and topic != self.topic:  # ZMQ filters by prefix: kv@ns/llm also takes kv@ns/llm2
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if duplicates:
                    if duplicates.get(seq) == payload:
                        continue
                    duplicates.clear()
                view = self.index.view(url)
                if seq == view.last_seq + 1:
                    self._apply(url, seq, payload)
                    continue
                # A gap, a first batch from an engine that ran before we subscribed, or a restart (seq went back).
                self.index.reset(url, "restarted" if seq <= view.last_seq else f"sequence gap at {seq}")
                duplicates = await self._replay(url, host, replay_port)
                if seq > self.index.view(url).last_seq and seq not in duplicates:
                    if self.index.view(url).last_seq >= 0 and seq != self.index.view(url).last_seq + 1:
                        self.index.reset(url, f"replay ended before {seq}")
                    self._apply(url, seq, payload)  # without replay: a view from here on (a subset, never stale)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a broken stream loses this engine's precision, never the gateway
            log.exception("KV events from %s: subscriber failed; routing falls back to approximate", url)
            self.index.reset(url, "subscriber failed")
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _apply(self, url: str, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except Exception as e:  # noqa: BLE001 - an undecodable batch is a gap: the view cannot be trusted
            self.index.reset(url, f"undecodable batch {seq}: {e}")
            return
        self.index.apply(url, seq, events)

    async def _replay(self, url: str, host: str, replay_port: int | None) -> dict[int, bytes]:
        """Apply the engine's buffered batches from sequence 0 (consecutive ones only, onto a reset view);
        returns them by sequence number. Nothing when the engine has no replay socket or does not answer."""
        if not replay_port:
            return {}
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        replayed: dict[int, bytes] = {}
        try:
            dealer.connect(f"tcp://{host}:{replay_port}")
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while await dealer.poll(int(REPLAY_TIMEOUT * 1000)):
                _, seq_bytes, payload = await dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    break
                view = self.index.view(url)
                if view.last_seq >= 0 and seq != view.last_seq + 1:
                    self.index.reset(url, f"replay gap at {seq}")
                self._apply(url, seq, payload)
                replayed[seq] = payload
            else:
                log.info("KV events from %s: no replay answer within %gs", url, REPLAY_TIMEOUT)
        finally:
            dealer.close(linger=0)
        return replayed
