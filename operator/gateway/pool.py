"""A pool: the engines of one InferenceService (or the `--endpoint` URLs) and the gateway's decisions about them.

A per-service gateway has one pool; the shared gateway (fleet.py) one per InferenceService, each found by the
request's `model`. A pool owns its backend set, its router (filters -> scorers -> picker, routing.py), the poll
of its engines, and admission (admission.py):

* with `max_inflight` > 0 (`--max-inflight-per-engine`, or the service's engine.maxNumSeqs in the shared gateway)
  an engine takes a request while its occupancy (running + queued there, see Backend.occupancy) is below it; a
  request that finds every engine full waits in the pool's FairQueue and is dispatched, in priority and fair
  order, the moment a slot frees. 0: no limit (the engines queue), and requests wait only for an engine to exist;
* with no engine at all, a request waits up to `hold_timeout` (scale from zero: the `on_hold` hooks wake the
  autoscaler); 0 answers 503 at once;
* a request naming one of the pool's LoRA adapters goes only to engines that list it in their /v1/models (read by
  the poller with their metrics; engines whose list is unknown — stale, or not read since they came back — only
  when no engine lists it). When engines exist but none lists it yet (added to spec.adapters and still loading, or
  the engines restarted and reload it) the request is held apart from the queue — it blocks nobody — until one
  does, up to `queue_timeout` (then 503 adapter_not_loaded). A name is one of the pool's adapters while it is
  declared (spec.adapters: read by the shared gateway, and by a per-service gateway with --inference-service,
  own_service.py) or some engine listed it within ADAPTER_MEMORY; any other name
  (the base model, an unknown one) goes to every engine as before.

The engine is picked when the request is admitted (the router runs among the engines with a free slot), so a
slot is never promised twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shoal.operator.gateway.admission import FairQueue, Shed, Ticket
from shoal.operator.gateway.backends import ADAPTER_MEMORY, Backend, BackendSet
from shoal.operator.gateway.routing import Pick, Router

log = logging.getLogger("shoal.gateway.pool")


class Unavailable(Exception):
    """No engine could take the request (503 + Retry-After)."""


class AdapterNotLoaded(Unavailable):
    """Engines exist, but none listed the request's adapter within the wait (503 adapter_not_loaded)."""

    def __init__(self, model: str, waited: float):
        super().__init__(f"the adapter `{model}` is not loaded on any engine yet (waited {waited:g} s); retry shortly")


@dataclass(eq=False)
class Pool:
    backends: BackendSet
    router: Router
    hold_timeout: float = 0.0  # wait this long for an engine when none is ready (0: 503 at once)
    max_inflight: int = 0  # per engine; 0: no limit
    queue_timeout: float = 60.0  # how long a request may wait for a free slot
    priority: int = 0  # of its requests (spec.priority)
    model_priorities: dict[str, int] = field(default_factory=dict)  # adapters with a priority of their own
    namespace: str = ""  # the InferenceService's, in the shared gateway
    name: str = ""
    served_name: str | None = None
    adapters: frozenset[str] = frozenset()  # the adapters the service declares (spec.adapters)
    engine_priority: bool = False  # the engines schedule by priority: tell them the request's (proxy.py)
    runtime: str = "shoal"
    # The service's prefill engines (spec.prefill) in the shared gateway: a disaggregation.RemotePrefill, or None
    remote_prefill: Any = None
    # Called (synchronously) when a request starts waiting for an engine to exist: a scale-from-zero hook.
    on_hold: list[Callable[[], None]] = field(default_factory=list)
    queue: FairQueue = field(default_factory=FairQueue)
    held: int = 0  # requests waiting because no engine exists
    adapter_waits: int = 0  # requests waiting for an engine to list their adapter
    draining: bool = False
    # metrics hooks: a routing decision (pick, seconds it took), a dispatch (ticket, seconds it waited), and
    # (start, end) of a request held for an engine to exist
    on_pick: Callable[[Pick, float], None] | None = None
    on_dispatch: Callable[[Ticket, float], None] | None = None
    on_held: tuple[Callable[[], None], Callable[[], None]] | None = None
    _pump_task: asyncio.Task | None = None
    _closed: BaseException | None = None

    def __post_init__(self):
        self.backends.listeners.append(self.pump)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.name else ""

    def priority_of(self, model: str | None) -> int:
        """The priority of a request for `model`: its adapter's own (spec.adapters[].priority), else the pool's."""
        return self.model_priorities.get(model, self.priority) if model else self.priority

    # ---- adapters --------------------------------------------------------------------------------------------
    def is_adapter(self, model: str | None, now: float) -> bool:
        """Is `model` one of this pool's LoRA adapters: declared, or listed by an engine within ADAPTER_MEMORY?"""
        if not model or model == self.served_name:
            return False
        return model in self.adapters or any(now - b.listed.get(model, -ADAPTER_MEMORY - 1) <= ADAPTER_MEMORY
                                             for b in self.backends.all())

    def serving(self, model: str | None, backends: list[Backend], now: float) -> list[Backend]:
        """The engines of `backends` a request for `model` may go to: for an adapter, those that list it, else
        those whose list is unknown (never one that does not list it); for any other name, all of them."""
        if not self.is_adapter(model, now):
            return backends
        listing = [b for b in backends if b.adapters_fresh(now) and model in b.adapters]
        return listing or [b for b in backends if not b.adapters_fresh(now)]

    async def _await_adapter(self, model: str) -> None:
        """Hold a request for an adapter that no engine lists while engines exist (being loaded): until one lists
        it (or no engine is left: admission then holds or answers as for any request), up to queue_timeout. Held
        apart from the fair queue, so it delays no other request."""
        started = time.monotonic()
        self.adapter_waits += 1  # not `held`: more engines would not help (the autoscaler reads held)
        try:
            while True:
                if self._closed is not None:
                    raise self._closed
                if self.draining:
                    raise Unavailable()
                now = time.monotonic()
                eligible = self.backends.eligible(now)
                if not eligible or self.serving(model, eligible, now):
                    return
                if now - started >= self.queue_timeout:
                    raise AdapterNotLoaded(model, self.queue_timeout)
                await asyncio.sleep(0.05)  # the poller reads every engine's list each poll interval
        finally:
            self.adapter_waits -= 1

    # ---- admission -------------------------------------------------------------------------------------------
    def _with_room(self, now: float, exclude: tuple[Backend, ...] = (), model: str | None = None) -> list[Backend]:
        eligible = self.serving(model, self.backends.eligible(now, exclude), now)
        if self.max_inflight <= 0:
            return eligible
        return [b for b in eligible if b.occupancy(now) < self.max_inflight]

    def pick(self, ticket: Ticket, exclude: tuple[Backend, ...] = (), *, room: bool = True) -> Backend | None:
        """Route the request among the engines with a free slot (any eligible one when `room` is False: a retry
        after a failed first attempt, which already held a slot); the engine's in-flight count is taken here."""
        started = time.perf_counter()
        now = time.monotonic()
        candidates = self._with_room(now, exclude, ticket.model) if room else \
            self.serving(ticket.model, self.backends.eligible(now, exclude), now)
        if ticket.instance is not None:  # only that engine has the stored response: no other will do
            candidates = [b for b in candidates if b.instance == ticket.instance]
        elif ticket.revision is not None and candidates:
            candidates = self._of_revision(ticket.revision, candidates, now, exclude)
        if not candidates:
            return None
        pick = self.router.pick(candidates, ticket.hashes, now, ticket.model, ticket.tokens,
                                ticket.model if ticket.tokens and self.is_adapter(ticket.model, now) else None)
        self.router.record(pick.backend, ticket.hashes, now)
        ticket.pick = pick
        b = pick.backend
        b.inflight += 1
        ahead = b.tenants.get(ticket.tenant, 0)
        tenants = len(b.tenants) + (0 if ahead else 1)
        ticket.share = ahead * tenants - sum(b.tenants.values())
        b.tenants[ticket.tenant] = ahead + 1
        if self.on_pick is not None:
            self.on_pick(pick, time.perf_counter() - started)
        return pick.backend

    def storing(self, instance: str) -> Backend | None:
        """The engine of this pool whose stored responses carry `instance` (gateway_contract.py), if it is here."""
        return next((b for b in self.backends.all() if b.instance == instance), None)

    def _of_revision(self, revision: str, candidates: list[Backend], now: float,
                     exclude: tuple[Backend, ...]) -> list[Backend]:
        """The canary split (gateway/canary.py): the candidates of the request's revision while that revision has an
        engine that may take requests (its full engines make the request wait for a slot there), else all of them —
        a revision without engines never strands a request."""
        if any(b.revision == revision for b in self.backends.eligible(now, exclude)):
            return [b for b in candidates if b.revision == revision]
        return candidates

    async def admit(self, ticket: Ticket, enqueue: Callable[[Ticket], None] | None = None) -> Backend:
        """The engine that runs this request, its in-flight count already taken: at once while an engine has
        room and nobody waits before it, else after waiting in the queue. Raises Unavailable (no engine within
        the hold) or Shed (no slot within queue_timeout, or shed for a more important request).
        `enqueue(ticket)` is the gateway's bound on waiting requests (it may shed another one, or refuse)."""
        if self.draining:
            raise Unavailable()
        now = time.monotonic()
        if self.is_adapter(ticket.model, now) and (engines := self.backends.eligible(now)) and \
                not self.serving(ticket.model, engines, now):
            await self._await_adapter(ticket.model)
        if not self.queue:
            backend = self.pick(ticket)
            if backend is not None:
                self.queue.charge(ticket)
                self._dispatched(ticket)
                return backend
        now = time.monotonic()
        none = not self.backends.eligible(now)
        if none and self.hold_timeout <= 0:
            raise Unavailable()
        if enqueue is not None:
            enqueue(ticket)  # may raise Shed
        future = ticket.future = asyncio.get_running_loop().create_future()
        self.queue.push(ticket)
        holding = none
        if holding:
            self.held += 1
            if self.on_held is not None:
                self.on_held[0]()
            for hook in self.on_hold:
                hook()
        self._ensure_pump()
        try:
            await asyncio.wait_for(asyncio.shield(future), self.hold_timeout if none else self.queue_timeout)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:  # the client left while waiting
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result(), ticket)  # granted in the same instant: give the slot back
            future.cancel()
            raise
        finally:
            self.queue.remove(ticket)
            if holding:
                self.held -= 1
                if self.on_held is not None:
                    self.on_held[1]()
        if future.done():
            return future.result()  # the engine, or the reason it was refused (shed, draining, deleted)
        future.cancel()  # out of the queue: nothing grants it now
        if not self.backends.eligible():
            raise Unavailable()
        raise Shed("queue_timeout", f"no engine slot freed within {self.queue_timeout:g} s")

    def pump(self) -> None:
        """Dispatch waiting requests while engines have room, in the queue's order (a slot freed, an engine
        appeared, load data changed). Draining: everything waiting is answered 503 at once."""
        if not self.queue:
            return
        if self.draining:
            while (t := self.queue.pop()) is not None:
                t.refuse(Unavailable())
            return
        while (t := self.queue.peek()) is not None:
            if t.future is not None and t.future.done():  # gone (timeout, client): removed by its own task
                self.queue.remove(t)
                continue
            backend = self.pick(t)
            if backend is None:
                return
            self.queue.pop()
            self._dispatched(t)
            t.grant(backend)

    def _dispatched(self, ticket: Ticket) -> None:
        if self.on_dispatch is not None:
            self.on_dispatch(ticket, time.monotonic() - ticket.arrived)

    def release(self, backend: Backend, ticket: Ticket) -> None:
        """A request left the engine (answered, failed, or the client went away): its slot is free."""
        backend.inflight -= 1
        left = backend.tenants.get(ticket.tenant, 1) - 1
        if left > 0:
            backend.tenants[ticket.tenant] = left
        else:
            backend.tenants.pop(ticket.tenant, None)
        self.pump()

    def _ensure_pump(self) -> None:
        """While requests wait, re-check now and then too: other gateways' load (from polls) and circuit
        cooldowns change without an event."""
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump_while_waiting(),
                                                                     name=f"admission-{self.key}")

    async def _pump_while_waiting(self) -> None:
        while self.queue:
            self.pump()
            await asyncio.sleep(0.05)

    def start_draining(self) -> None:
        self.draining = True
        self.pump()

    def close(self, error: BaseException) -> None:
        """The pool is gone (its InferenceService was deleted): everything waiting gets `error`."""
        self._closed = error
        while (t := self.queue.pop()) is not None:
            t.refuse(error)
        if self.pump in self.backends.listeners:
            self.backends.listeners.remove(self.pump)
        if self._pump_task is not None:
            self._pump_task.cancel()
