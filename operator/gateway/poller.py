"""Polls every engine's readiness endpoint (/readyz for Shoal's engine, /health for vLLM's) and /metrics about
every 250 ms, concurrently and with one timeout per poll.

One task per round polls all engines at once; an engine whose previous poll is still running is skipped (a
hung engine costs one pending poll, never a pile of them), so a slow engine cannot delay the others' data.
Only the load gauges are read from /metrics, by the names of the engines' runtime (metric_names.py), with a line
scan rather than a full Prometheus parse. A ready engine's /v1/models is read in the same poll (concurrently with
/metrics): the adapters it lists (cards with a `parent`) are the ones a request may be sent there for (pool.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import aiohttp

from shoal.operator.gateway.backends import Backend, BackendSet
from shoal.operator.gateway.metric_names import SHOAL, EngineMetrics, scan

log = logging.getLogger("shoal.gateway.poller")

def parse_load(text: str, metrics: EngineMetrics = SHOAL) -> dict[str, float]:
    """running / waiting / kv_usage from an engine's Prometheus text (summed over label sets; KV as max)."""
    load = scan(text, metrics)
    return {"running": load["running"], "waiting": load["waiting"], "kv_usage": load["kv_usage"]}


def _label(line: str, name: str) -> str | None:
    start = line.find(f'{name}="')
    if start < 0:
        return None
    start += len(name) + 2
    return line[start:line.find('"', start)]


def parse_lora(text: str, metrics: EngineMetrics = SHOAL) -> dict:
    """Resident adapters and slot use from an engine's LoRA info gauges, by its runtime's names (metric_names.py;
    label values: comma-separated adapter names, empty when the engine serves no adapters), and its base model's
    name (the model_name label of its running-requests gauge)."""
    out = {"lora_resident": frozenset(), "max_cpu_loras": 0, "lora_running": 0, "max_loras": 0}
    named: set[str] = set()  # adapters lora_info names (running or waiting): resident where no gauge says more
    has_resident = False
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in metrics.running and "{" in line:
            out["served_model"] = _label(line, "model_name")
        elif name in metrics.lora_resident:
            names = _label(line, "resident_lora_adapters") or ""
            out["lora_resident"] = frozenset(n for n in names.split(",") if n)
            out["max_cpu_loras"] = int(_label(line, "max_cpu_lora") or 0)
            has_resident = True
        elif name in metrics.lora_info:
            running = [n for n in (_label(line, "running_lora_adapters") or "").split(",") if n]
            waiting = [n for n in (_label(line, "waiting_lora_adapters") or "").split(",") if n]
            out["lora_running"] = len(running)
            out["max_loras"] = int(float(_label(line, "max_lora") or 0))
            named = set(running) | set(waiting)
    if not has_resident and not metrics.lora_resident:
        out["lora_resident"] = frozenset(named)
    return out


def parse_adapters(body) -> frozenset[str] | None:
    """The adapters an engine's /v1/models lists (cards with a `parent`: Shoal's engine and vLLM), or None when the
    answer is not a model list."""
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list):
        return None
    return frozenset(c["id"] for c in cards if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str))


class Poller:
    def __init__(self, backends: BackendSet, session: aiohttp.ClientSession, interval: float = 0.25,
                 timeout: float = 1.0, metrics: EngineMetrics = SHOAL,
                 headers: Callable[[], dict[str, str]] = dict):
        self.backends = backends
        self.headers = headers  # for /v1/models: the engines' key, when they have one
        self.session = session
        self.interval = interval
        self.timeout = timeout  # seconds for one poll: /readyz and /metrics together
        self.metrics = metrics
        self._polling: dict[Backend, asyncio.Task] = {}

    async def run(self) -> None:
        while True:
            for b in self.backends.all():
                task = self._polling.get(b)
                if task is None or task.done():
                    self._polling[b] = asyncio.create_task(self.poll(b))
            # Forget engines that left the set once their last poll is over.
            for b in [b for b, t in self._polling.items() if b.removed and t.done()]:
                del self._polling[b]
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        for t in self._polling.values():
            t.cancel()
        await asyncio.gather(*self._polling.values(), return_exceptions=True)

    async def poll(self, b: Backend) -> None:
        """The readiness path, then /metrics and (ready engines) /v1/models in what is left of the poll's timeout. A
        readiness answer counts even when the others do not come in time (a busy engine renders them slower): only
        the load data and the adapter list go stale. A not-ready engine's adapter list is forgotten: an engine that
        restarts in place lists what it serves when it is ready again, read in that same poll."""
        was_usable = b.usable(time.monotonic())
        deadline = time.monotonic() + self.timeout
        try:
            async with self.session.get(b.url + self.metrics.ready_path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                answer = await r.read()
                ready = r.status == 200
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            b.ready, b.last_answer = False, time.monotonic()  # nobody listens: a definite "no"
            b.forget_adapters()
            b.instance = None  # whatever listens here next is another process, with a store of its own
            self._changed(b, was_usable)
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.debug("poll of %s failed: %r", b.url, e)  # no answer: the data goes stale, then stalled
            return
        b.instance = instance_of_readiness(answer)
        left = deadline - time.monotonic()
        listing = ready and self.metrics.lists_adapters
        text, adapters = await asyncio.gather(self._metrics(b, left), self._adapters(b, left) if listing else _none())
        now = time.monotonic()
        b.ready, b.last_answer = ready, now
        if not ready:
            b.forget_adapters()
        elif adapters is not None:
            b.read_adapters(adapters, now)
        if text is not None:
            load = scan(text, self.metrics)
            b.running, b.waiting, b.kv_usage = load["running"], load["waiting"], load["kv_usage"]
            b.waiting_prefill_tokens = load["waiting_prefill_tokens"]
            b.inflight_at_poll = b.inflight
            for key, value in parse_lora(text, self.metrics).items():
                setattr(b, key, value)
            b.last_ok = now
        if ready and not b.circuit_open(now):
            b.failures = 0  # a healthy answer forgives earlier failures of a closed circuit
        self._changed(b, was_usable)

    async def _metrics(self, b: Backend, left: float) -> str | None:
        if left <= 0:
            return None
        try:
            async with self.session.get(b.url + "/metrics", timeout=aiohttp.ClientTimeout(total=left)) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.debug("metrics of %s did not come in time: %r", b.url, e)
            return None

    async def _adapters(self, b: Backend, left: float) -> frozenset[str] | None:
        """The adapters the engine lists now; None when it did not say in time (its list goes stale: unknown)."""
        if left <= 0:
            return None
        try:
            async with self.session.get(b.url + "/v1/models", headers=self.headers(),
                                        timeout=aiohttp.ClientTimeout(total=left)) as r:
                return parse_adapters(await r.json(content_type=None)) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.debug("/v1/models of %s did not come in time: %r", b.url, e)
            return None

    def _changed(self, b: Backend, was_usable: bool) -> None:
        if b.usable(time.monotonic()) != was_usable:
            self.backends.notify()


def instance_of_readiness(body: bytes) -> str | None:
    """The stored-response tag a Shoal engine's /readyz names (gateway_contract.py); None from any other."""
    try:
        instance = json.loads(body).get("instance") if body else None
    except (ValueError, AttributeError):
        return None
    return instance if isinstance(instance, str) and instance else None


async def _none() -> None:
    return None
