"""The backend set: which engines exist, which may take traffic now, and how loaded each one is.

Three sources of truth meet here, each with its own failure mode:
- discovery (static URLs or EndpointSlices) says which engines exist and are Ready; an engine that leaves the
  set (a draining pod) gets no new request at once, while its in-flight requests finish;
- the poller's /readyz and /metrics answers: a definite "not ready" (non-200, connection refused) excludes the
  engine; data older than `stale_after` is *unknown* (scored by the gateway's own counts, still eligible);
  no answer for longer than `stall_after` marks it stalled (excluded while a healthy engine exists — never
  halting dispatch when every engine looks stalled);
- the proxy's own outcomes: consecutive failures open the engine's circuit for `circuit_cooldown` seconds.

`BackendSet.listeners` are told of every change (an engine appeared or left, a circuit opened, readiness flipped):
the pool's admission re-checks its waiting requests then (pool.py), which is how a request held while a fleet
scales from zero goes the moment its first engine is Ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from shoal.operator.gateway.options import option, positive


# An engine the gateway woke up (POST /wake_up) is routed to at once, before its endpoint turns Ready (the readiness
# probe's period, seconds): it stays a backend this long while discovery still lists it as not ready.
WOKEN_GRACE = 30.0

# An adapter an engine listed this recently is still its pool's (its engine may be reloading it after a restart):
# a request for it waits for an engine that lists it rather than going to one that would answer 404.
ADAPTER_MEMORY = 300.0


@dataclass
class HealthPolicy:
    """When an engine's load is unknown, when it is skipped, and when its circuit opens (shoal-gateway flags)."""

    stale_after: float = option(1.0, "reliability", "seconds without a successful load poll after which an engine's "
                                "load is unknown", type=positive(float))
    stall_after: float = option(2.0, "reliability", "seconds without any poll answer after which an engine is "
                                "stalled: skipped while others answer", type=positive(float))
    circuit_failures: int = option(3, "reliability", "consecutive proxy failures that open an engine's circuit",
                                   type=positive(int))
    circuit_cooldown: float = option(5.0, "reliability", "seconds an open circuit stays open before one trial "
                                     "request", type=positive(float))


@dataclass(eq=False)
class Backend:
    url: str
    policy: HealthPolicy
    revision: str = "stable"  # stable | canary (spec.canary: discovery reads it from the endpoint's pod)
    added_at: float = field(default_factory=time.monotonic)
    removed: bool = False
    # Counted by this gateway.
    inflight: int = 0
    tenants: dict[str, int] = field(default_factory=dict)  # in-flight requests per tenant (engine priority)
    # From the poller; `ready` is None until a poll answered.
    ready: bool | None = None
    last_answer: float | None = None  # any poll answer (even "not ready")
    last_ok: float | None = None  # a poll that returned load data
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    waiting_prefill_tokens: float = 0.0
    inflight_at_poll: int = 0  # this gateway's in-flight count when the load data was read (occupancy())
    # LoRA adapters (the engine's lora_resident_info / lora_requests_info): loaded ones, how many it keeps loaded
    # (0: LoRA off or unknown), and how many run in its batches now of at most max_loras.
    lora_resident: frozenset[str] = frozenset()
    max_cpu_loras: int = 0
    lora_running: int = 0
    max_loras: int = 0
    served_model: str | None = None  # the engine's base model name (its metrics' model_name label)
    # The tag in the ids of the responses this engine process stores (its /readyz `instance`; None: not said yet,
    # or not a Shoal engine): requests about one of them go here (gateway_contract.py).
    instance: str | None = None
    # The adapters the engine serves now: the cards with a `parent` in its /v1/models (polled with its metrics).
    # None: unknown (not polled yet, the poll failed, or the engine went away: a restarted engine lists its own).
    adapters: frozenset[str] | None = None
    adapters_at: float | None = None  # when `adapters` was read
    listed: dict[str, float] = field(default_factory=dict)  # adapter -> when the engine last listed it
    # Circuit breaker.
    failures: int = 0
    open_until: float = 0.0

    def fresh(self, now: float) -> bool:
        return self.last_ok is not None and now - self.last_ok <= self.policy.stale_after

    def adapters_fresh(self, now: float) -> bool:
        """The adapter list is current (read within stale_after): an adapter it lacks is not served there."""
        return self.adapters is not None and self.adapters_at is not None and \
            now - self.adapters_at <= self.policy.stale_after

    def read_adapters(self, adapters: frozenset[str], now: float) -> None:
        self.adapters, self.adapters_at = adapters, now
        for name in adapters:
            self.listed[name] = now
        if len(self.listed) > len(adapters):
            self.listed = {n: t for n, t in self.listed.items() if now - t <= ADAPTER_MEMORY}

    def forget_adapters(self) -> None:
        """The engine stopped answering (refused, not ready): whatever it lists when back is read anew."""
        self.adapters, self.adapters_at = None, None

    def stalled(self, now: float) -> bool:
        since = self.last_answer if self.last_answer is not None else self.added_at
        return now - since > self.policy.stall_after

    def circuit_open(self, now: float) -> bool:
        return now < self.open_until

    def usable(self, now: float) -> bool:
        """May take a new request (before the stalled check, which only applies while others are healthy)."""
        return not self.removed and self.ready is not False and not self.circuit_open(now)

    def load(self, now: float) -> float:
        """Requests' worth of load: the gateway's own in-flight count, or the engine's running + waiting when
        that is higher (other gateway replicas send to it too), with queued requests counted twice (a queue
        means the engine is saturated) and a nearly full KV cache as one more (preemption ahead). Stale or
        missing engine data: the gateway's own count alone."""
        if not self.fresh(now):
            return float(self.inflight)
        return (max(float(self.inflight), self.running + self.waiting) + self.waiting
                + (1.0 if self.kv_usage >= 0.95 else 0.0))

    def occupancy(self, now: float) -> int:
        """Requests the engine runs or queues now, for admission (a slot per running sequence): this gateway's own
        in-flight count, exact and current, plus what others (other gateway replicas, direct clients) had there at
        the last fresh poll — the engine's running + waiting minus what was ours then. Counting our own requests
        live means a slot freed here is reused at once, not after the next poll."""
        if not self.fresh(now):
            return self.inflight
        return self.inflight + max(0, int(self.running + self.waiting) - self.inflight_at_poll)

    # Outcomes reported by the proxy and the poller.
    def on_success(self) -> None:
        self.failures = 0
        self.open_until = 0.0

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.policy.circuit_failures:
            self.open_until = now + self.policy.circuit_cooldown

    def on_refused(self, now: float) -> None:
        """Nobody listens: not ready until a poll says otherwise (an engine that restarts comes back at once)."""
        self.ready = False
        self.forget_adapters()
        self.on_failure(now)


class BackendSet:
    """The engines the gateway may route to, keyed by base URL."""

    def __init__(self, policy: HealthPolicy | None = None):
        self.policy = policy or HealthPolicy()
        self._backends: dict[str, Backend] = {}
        self.canary_percent = 0.0  # share of conversations for the canary revision's engines (gateway/canary.py)
        self.split = False  # a canary revision is in the set (or announced): every request picks a revision
        self.listeners: list[Callable[[], None]] = []  # told of every change (admission re-checks its queue)
        # Endpoints that exist but are not Ready and not terminating: loading, or parked asleep (scaleToZero
        # sleep), which the gateway may wake (wake.EngineWaker); and those it woke, with when.
        self.standby: frozenset[str] = frozenset()
        self.woken: dict[str, float] = {}
        self._ready: set[str] = set()

    def __len__(self) -> int:
        return len(self._backends)

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def replace(self, urls: set[str] | list[str], standby: set[str] | frozenset[str] = frozenset()) -> None:
        """Make the set exactly `urls` (discovery's view: the Ready endpoints), plus the engines this gateway
        woke that are still listed in `standby` (the not-ready ones) and not Ready yet. Engines that left are
        marked removed, so requests still holding them finish but no new one is sent there."""
        self._ready = {u.rstrip("/") for u in urls}
        self.standby = frozenset(u.rstrip("/") for u in standby)
        now = time.monotonic()
        self.woken = {u: t for u, t in self.woken.items()
                      if u in self.standby and u not in self._ready and now - t < WOKEN_GRACE}
        self._apply(self._ready | set(self.woken))

    def add_woken(self, url: str) -> None:
        """An engine this gateway just woke up: a backend now, before discovery says it is Ready."""
        self.woken[url] = time.monotonic()
        self._apply(self._ready | set(self.woken))

    def _apply(self, wanted: set[str]) -> None:
        for url in list(self._backends):
            if url not in wanted:
                self._backends.pop(url).removed = True
        for url in sorted(wanted):
            if url not in self._backends:
                self._backends[url] = Backend(url, self.policy)
        self.notify()

    def set_revisions(self, revisions: dict[str, str], canary_percent: float) -> None:
        """Each engine's revision (URLs not named are stable) and the canary's share, from discovery."""
        for url, backend in self._backends.items():
            backend.revision = revisions.get(url, "stable")
        self.canary_percent = canary_percent
        self.split = canary_percent > 0 or any(b.revision != "stable" for b in self._backends.values())

    def eligible(self, now: float | None = None, exclude: tuple[Backend, ...] = ()) -> list[Backend]:
        """Engines that may take a new request, sorted by URL (a stable order for round-robin and ties).
        Stalled engines count only when no other engine is usable: stale data never halts dispatch."""
        now = time.monotonic() if now is None else now
        usable = [b for b in self._backends.values() if b.usable(now) and b not in exclude]
        healthy = [b for b in usable if not b.stalled(now)]
        return sorted(healthy or usable, key=lambda b: b.url)

    def notify(self) -> None:
        """Tell the listeners that the set or some engine's state changed (waiting requests may go now)."""
        for listener in self.listeners:
            listener()
