"""The autoscaling loop: for every InferenceService with `spec.autoscaling`, observe the load every second (or at
once when the gateway asks), decide (autoscaling.decide) and set the replica count,
`status.autoscaling.desiredReplicas` (spec.replicas stays the user's manifest: a re-applied manifest or a GitOps
sync does not fight the autoscaler).

Watch, never list
    What a decision reads — InferenceServices, the EndpointSlices of their engine and gateway Services (which carry
    the Services' labels, so one label selector finds every slice of ours), the gateways' wake-up ConfigMaps and
    kopf's peering objects — comes from watch-fed caches (k8s/informer.py), listed once. The caches keep running on a
    standby replica, which takes over with current data.
Lead
    Exactly one operator replica scales: the one kopf's peering lets reconcile (leadership.py applies kopf's rule
    to the peering object). The autoscaler is a task of its own, not a kopf daemon: daemons put a finalizer on
    every autoscaled InferenceService, which then cannot be deleted once the operator is gone (`helm uninstall`
    first). Each autoscaled service gets a loop while this replica leads; losing the lead stops them all.
Observe
    Where the load is read is `spec.autoscaling.loadSource`:
    * engines: each engine's /metrics (running/waiting requests, KV-cache usage, prompt tokens waiting for prefill);
    * gateways: the gateways' /metrics alone — the requests each has in flight to each engine, and the engines'
      load as the gateway polls it (for engines the operator cannot reach, e.g. behind Istio STRICT mTLS, which
      the gateways, inside the mesh, reach);
    * auto (the default): the engines, and for an engine that does not answer, the gateways' view of it; an engine
      that keeps failing is scraped less often (backoff up to a minute) while the gateways cover it.
    The gateways' /metrics also give the requests they hold while no engine is ready. Scrapes run at most
    `max_concurrent_scrapes` at a time across the whole fleet, each within SCRAPE_TIMEOUT; a Ready endpoint whose
    load nobody could report is unknown load (never idleness).
Wake-up
    A gateway that starts holding a request while no engine is ready annotates its wake-up ConfigMap
    (`<name>-wake`, the one object it may patch) with `serving.shoal.dev/wake-requested-at` (a merge patch, at
    most once a second). The annotation goes through the API server, so it reaches whichever operator replica
    leads and survives an operator restart; the watch sees it within milliseconds and the loop decides at once
    instead of on the next tick. An annotation seen for the first time (an operator restart, a new leader) wakes
    only if it is recent: one left from a past wake-up must not start a replica; requests that are really waiting
    show in the gateway's held count anyway.
Act
    Scale-up and scale-down patch `status.autoscaling.desiredReplicas`, which the reconciler renders the
    Deployment (or the groups) from, with the resourceVersion the decision was made on: a write based on a stale
    view (another replica scaled meanwhile) is refused and decided again. Before a scale-down of a Deployment the
    pods are annotated with `controller.kubernetes.io/pod-deletion-cost` from their in-flight counts, so the
    ReplicaSet removes the least busy ones. Removal then drains without cutting streams: the terminating pod's
    endpoint turns not-ready (the gateway sends it nothing new), the engine's SIGTERM handler finishes its in-flight
    requests within `engine.shutdownTimeoutSeconds`, and the pod's grace period is longer than that drain.
    With `autoscalerClass: external` nothing is written: the inputs and the recommendation are only exported, for
    an HPA or a KEDA ScaledObject that scales spec.replicas through the scale subresource.
Report
    `status.autoscaling` (current/desired/needed replicas, reason, message, the inputs, times), an `Autoscaling`
    condition, an Event per scaling, and `shoal:autoscaler_*` metrics on the operator's --metrics-port.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from shoal.operator.gateway import metric_names
from shoal.operator import api, contract, render
from shoal.operator.contract import (A_SLEEPING, A_WAKE, GATEWAY_BATCH_PENDING_REQUESTS, GATEWAY_ENGINE_GAUGES,
                                     GATEWAY_HELD_REQUESTS, GATEWAY_INFLIGHT_REQUESTS, L_SERVICE_NAME)
from shoal.operator.autoscaling import (Decision, History, Observation, Parking, Policy, ReplicaLoad, decide, park,
                                        pick_victims)
from shoal.operator.k8s.client import KubeAPI
from shoal.operator.k8s.informer import Informers
from shoal.operator.kube import ApiError, Kube
from shoal.operator.leadership import Leadership

logger = logging.getLogger("shoal.operator.autoscaler")

A_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
INTERVAL = 1.0  # seconds between decisions without a wake-up
SCRAPE_TIMEOUT = 1.0  # one /metrics, from when it may start (the fleet-wide bound below)
MAX_CONCURRENT_SCRAPES = 32  # across every InferenceService (--max-concurrent-scrapes)
ENGINE_BACKOFF_MAX = 60.0  # loadSource auto: an engine that keeps failing is scraped at most this rarely
STATUS_REFRESH = 15.0  # rewrite status.autoscaling at most this often when only the inputs moved
WAKE_FRESH = 30.0  # seconds: a wake-up annotation seen for the first time counts only if this recent
STOP_GRACE = 5.0  # seconds a loop may take to finish its tick once told to stop
# From zero, a held request makes the gateway wake a parked engine itself; the autoscaler wakes one only if none
# is awake this long after it saw the need (a gateway that could not), so one request wakes one engine, not two.
GATEWAY_WAKE_HEAD_START = 3.0
SLEEP_TIMEOUT = 30.0  # POST /sleep: frees the KV cache (and at level 2 the weights); seconds, not minutes
CONDITION = "Autoscaling"

REGISTRY = CollectorRegistry(auto_describe=False)
_L = ["namespace", "name"]
M_DESIRED = Gauge("shoal:autoscaler_desired_replicas", "Replicas the autoscaler wants (with autoscalerClass "
                  "external: recommends).", _L, registry=REGISTRY)
M_CURRENT = Gauge("shoal:autoscaler_current_replicas", "Replicas running when the autoscaler last looked.", _L,
                  registry=REGISTRY)
M_READY = Gauge("shoal:autoscaler_ready_replicas", "Replicas whose engine endpoint is ready.", _L, registry=REGISTRY)
M_STARTING = Gauge("shoal:autoscaler_starting_replicas", "Replicas asked for and not ready yet.", _L,
                   registry=REGISTRY)
M_NEEDED = Gauge("shoal:autoscaler_needed_replicas", "Replicas the load needs before stabilization and limits.", _L,
                 registry=REGISTRY)
M_IN_FLIGHT = Gauge("shoal:autoscaler_in_flight_requests", "Requests running or waiting on engines plus held.", _L,
                    registry=REGISTRY)
M_HELD = Gauge("shoal:autoscaler_held_requests", "Requests the gateways hold while no engine is ready.", _L,
               registry=REGISTRY)
M_KV = Gauge("shoal:autoscaler_kv_cache_usage", "KV-cache usage summed over serving engines.", _L, registry=REGISTRY)
M_PREFILL = Gauge("shoal:autoscaler_waiting_prefill_tokens", "Prompt tokens waiting for prefill on the engines.", _L,
                  registry=REGISTRY)
M_SLEEPING = Gauge("shoal:autoscaler_sleeping_replicas", "Replicas parked asleep (scaleToZero sleep): pods kept, "
                   "engines asleep.", _L, registry=REGISTRY)
M_UNKNOWN = Gauge("shoal:autoscaler_unknown_load_endpoints", "Ready engines and gateways whose load nobody could "
                  "report at the last decision.", _L, registry=REGISTRY)
M_SCALINGS = Counter("shoal:autoscaler_scalings", "Changes of the replica count made by the autoscaler, by reason.",
                     _L + ["reason"], registry=REGISTRY)
M_DECISION_SECONDS = Histogram("shoal:autoscaler_decision_seconds", "Time to observe and decide once.", _L,
                               buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5], registry=REGISTRY)
M_SCRAPES = Counter("shoal:autoscaler_scrapes", "/metrics scrapes of engines and gateways, by outcome (ok, failed, "
                    "skipped: an engine in backoff whose load the gateways report).", ["target", "result"],
                    registry=REGISTRY)
M_LEADING = Gauge("shoal:autoscaler_leading", "1 on the operator replica whose autoscaler acts, else 0.",
                  registry=REGISTRY)
M_PREFILL_DESIRED = Gauge("shoal:autoscaler_prefill_desired_replicas", "Prefill engines the autoscaler wants "
                          "(spec.prefill.autoscaling).", _L, registry=REGISTRY)
M_PREFILL_NEEDED = Gauge("shoal:autoscaler_prefill_needed_replicas", "Prefill engines the prefill load needs before "
                         "stabilization and limits.", _L, registry=REGISTRY)
M_PREFILL_TOKENS = Gauge("shoal:autoscaler_prefill_waiting_prefill_tokens", "Prompt tokens waiting on the prefill "
                         "engines (the decode engines' while none is ready).", _L, registry=REGISTRY)
PER_SERVICE = (M_PREFILL_DESIRED, M_PREFILL_NEEDED, M_PREFILL_TOKENS, M_DESIRED, M_CURRENT, M_SLEEPING, M_READY, M_STARTING, M_NEEDED, M_IN_FLIGHT, M_HELD, M_KV, M_PREFILL,
               M_UNKNOWN)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _recent(stamp: str, now: datetime.datetime | None = None) -> bool:
    """Whether a wake-up annotation's time (RFC 3339, as the gateway writes it) is within WAKE_FRESH of now."""
    try:
        t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return False
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return abs((now - t).total_seconds()) <= WAKE_FRESH


def engine_service(name: str, spec: api.InferenceServiceSpec) -> str:
    """The Service whose EndpointSlices list the serving (rank-0) engine pods."""
    return contract.serving_engines_service(name, spec.gateway.enabled)


def gateway_service(name: str, spec: api.InferenceServiceSpec) -> str | None:
    """The Service in front of the gateway pods, whose metrics report held requests (None: no gateway)."""
    return name if spec.gateway.enabled else None


def sleeps(spec: api.InferenceServiceSpec) -> bool:
    """scaleToZero sleep: the autoscaler parks idle replicas asleep instead of deleting them."""
    return spec.autoscaling is not None and spec.autoscaling.scale_to_zero == "sleep"


def policy_of(spec: api.InferenceServiceSpec) -> Policy:
    a = spec.autoscaling
    assert a is not None
    return Policy(min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                  target_in_flight=a.target_in_flight_per_replica, target_kv_cache_usage=a.target_kv_cache_usage,
                  target_waiting_prefill_tokens=a.target_waiting_prefill_tokens_per_replica,
                  scale_up_window=a.scale_up_stabilization_seconds,
                  scale_down_window=a.scale_down_stabilization_seconds,
                  scale_to_zero_after=a.scale_to_zero_after_seconds,
                  startup_timeout=spec.probes.startup_timeout_seconds)


def prefill_policy_of(spec: api.InferenceServiceSpec) -> Policy:
    """The prefill role's policy (spec.prefill.autoscaling): its own targets, no KV-cache signal."""
    a = spec.prefill.autoscaling
    assert a is not None
    return Policy(min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                  target_in_flight=a.target_in_flight_per_replica, target_kv_cache_usage=None,
                  target_waiting_prefill_tokens=a.target_waiting_prefill_tokens_per_replica,
                  scale_up_window=a.scale_up_stabilization_seconds,
                  scale_down_window=a.scale_down_stabilization_seconds,
                  scale_to_zero_after=a.scale_to_zero_after_seconds,
                  startup_timeout=spec.probes.startup_timeout_seconds)


def autoscaled(spec: dict[str, Any]) -> bool:
    """Whether the raw spec asks the autoscaler for anything: the replicas, the prefill role, or both."""
    return bool(spec.get("autoscaling") or (spec.get("prefill") or {}).get("autoscaling"))


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: sum over its label sets}."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


@dataclass
class GatewayView:
    """What one gateway's /metrics says (operator/gateway/metrics.py): requests it holds, its own in-flight count per
    engine, and the load of each engine whose data it has fresh, keyed by the engine's base URL."""

    held: float = 0.0
    batch_pending: float = 0.0  # batch requests not finished (the gateway's batch runner)
    in_flight: dict[str, float] = field(default_factory=dict)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)




def gateway_view(text: str) -> GatewayView:
    view = GatewayView()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            backend = sample.labels.get("backend")
            if sample.name == GATEWAY_HELD_REQUESTS:
                view.held += sample.value
            elif sample.name == GATEWAY_BATCH_PENDING_REQUESTS:
                view.batch_pending += sample.value
            elif sample.name == GATEWAY_INFLIGHT_REQUESTS and backend:
                view.in_flight[backend] = view.in_flight.get(backend, 0.0) + sample.value
            elif sample.name in GATEWAY_ENGINE_GAUGES and backend:
                view.engines.setdefault(backend, {})[GATEWAY_ENGINE_GAUGES[sample.name]] = sample.value
    return view


def load_from_gateways(url: str, views: list[GatewayView]) -> dict[str, float] | None:
    """An engine's load as the gateways report it: the engine's own gauges as any gateway polled them (the
    highest, should they differ), else the requests the gateways have in flight to it; None without a view."""
    polled = [v.engines[url] for v in views if url in v.engines]
    if polled:
        return {k: max(p.get(k, 0.0) for p in polled) for k in GATEWAY_ENGINE_GAUGES.values()}
    if not views:
        return None
    return {"running": sum(v.in_flight.get(url, 0.0) for v in views), "waiting": 0.0, "kv_usage": 0.0,
            "waiting_prefill_tokens": 0.0}


def engine_loads(spec: api.InferenceServiceSpec, engines: list["Endpoint"], texts: list[str | None],
                 views: list[GatewayView], source: str, polled_only: bool = False) -> tuple[list[ReplicaLoad], int]:
    """Each engine's load from its /metrics text, else (loadSource auto or gateways) from the gateways' view of it
    (`polled_only`: only the gauges a gateway polled, never its in-flight counts, which are decode traffic);
    -> (loads, Ready engines whose load nobody could report)."""
    names = metric_names.for_runtime(spec.runtime)  # vllm:num_requests_running for a vLLM fleet, ...
    replicas, unknown = [], 0
    for ep, text in zip(engines, texts):
        if text is not None:
            load = metric_names.load_from_sums(metric_sums(text), names)
        elif source == "engines":
            load = None
        elif polled_only:
            load = load_from_gateways(ep.url, [v for v in views if ep.url in v.engines])
        else:
            load = load_from_gateways(ep.url, views)
        if load is None:
            unknown += ep.ready  # only Ready engines: one still starting or crash-looping serves nothing yet
            load = {"running": 0, "waiting": 0, "kv_usage": 0.0, "waiting_prefill_tokens": 0}
        replicas.append(ReplicaLoad(
            pod=ep.pod or ep.url, ready=ep.ready, running=int(load["running"]), waiting=int(load["waiting"]),
            kv_cache_usage=load["kv_usage"], waiting_prefill_tokens=int(load["waiting_prefill_tokens"])))
    return replicas, unknown


@dataclass(frozen=True)
class Endpoint:
    url: str
    pod: str | None
    ready: bool
    terminating: bool = False


def endpoints(slices: list[dict[str, Any]], port_name: str | None = None) -> list[Endpoint]:
    """Every endpoint of these EndpointSlices (ready or not: a draining pod still carries requests), at the port
    named `port_name` when the slice has one, else its first TCP port."""
    found = []
    for s in slices:
        ports = [p for p in s.get("ports") or [] if p.get("port") and p.get("protocol", "TCP") == "TCP"]
        ports = [p for p in ports if p.get("name") == port_name] or ports
        if not ports:
            continue
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
            ref = ep.get("targetRef") or {}
            conditions = ep.get("conditions") or {}
            found.append(Endpoint(f"http://{host}:{ports[0]['port']}", ref.get("name"),
                                  conditions.get("ready") is not False, conditions.get("terminating") is True))
    return found


def _slice_service(obj: dict[str, Any]) -> tuple[str, str] | None:
    service = (obj["metadata"].get("labels") or {}).get(L_SERVICE_NAME)
    return (obj["metadata"].get("namespace"), service) if service else None


def watched_namespaces() -> tuple[str, ...]:
    """The namespaces the operator serves (`shoal-operator -n NS ...`, see __main__); () for every namespace."""
    return tuple(ns for ns in (os.environ.get("SHOAL_WATCH_NAMESPACES") or "").split(",") if ns)


@dataclass
class State:
    """Per InferenceService, in the operator's memory."""

    history: History = field(default_factory=History)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    woken_at: str | None = None  # the last wake annotation value acted upon
    respec: asyncio.Event = field(default_factory=asyncio.Event)  # the spec changed: decide now, on the new one
    generation: Any = None
    last_status: tuple | None = None
    last_status_time: float = 0.0
    last_scale_time: str | None = None
    # scaleToZero sleep: the engines' URLs by pod (last observation), wake-ups under way, and the sleep level each
    # pod's A_SLEEPING annotation was last set to (None: removed), so it is patched only when it changes
    urls: dict[str, str] = field(default_factory=dict)
    waking: dict[str, asyncio.Task] = field(default_factory=dict)
    marked: dict[str, str | None] = field(default_factory=dict)
    zero_need_since: float | None = None  # when a decision first wanted replicas while none was awake
    # the prefill role's own decision (spec.prefill.autoscaling): its history and what was last reported
    prefill_history: History = field(default_factory=History)
    prefill_last_status: tuple | None = None
    prefill_last_status_time: float = 0.0
    prefill_last_scale_time: str | None = None


@dataclass
class Loop:
    task: asyncio.Task
    stop: asyncio.Event


@dataclass
class Autoscaler:
    kube: Kube
    leadership: Leadership = field(default_factory=Leadership)
    peering_clusterwide: bool = True  # kopf's ClusterKopfPeering, else a KopfPeering per watched namespace
    namespaces: tuple[str, ...] = ()  # () watches every namespace
    interval: float = INTERVAL
    max_gpus_per_node: int = 8  # the operator's --max-gpus-per-node: specs validate as the reconciler's do
    max_concurrent_scrapes: int = MAX_CONCURRENT_SCRAPES
    states: dict[tuple[str, str], State] = field(default_factory=dict)
    loops: dict[tuple[str, str], Loop] = field(default_factory=dict)
    invalid_seen: set[tuple[str, str, Any]] = field(default_factory=set)  # (ns, name, generation) logged invalid
    failing: dict[str, tuple[int, float]] = field(default_factory=dict)  # engine URL -> (failures, next try)
    session: aiohttp.ClientSession | None = None
    isvcs: Informers | None = None
    slices: Informers | None = None
    wakes: Informers | None = None
    peerings: Informers | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _scrape_slots: asyncio.Semaphore | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def spec_of(self, isvc: dict[str, Any]) -> api.InferenceServiceSpec:
        return api.validate(isvc["metadata"]["name"], isvc.get("spec"), max_gpus_per_node=self.max_gpus_per_node)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, kube_api: KubeAPI | None = None) -> None:
        """Start the caches and the supervisor (from kopf's startup handler, on every replica)."""
        kube_api = kube_api or await asyncio.to_thread(KubeAPI.from_environment)
        ns = self.namespaces
        managed = contract.MANAGED_SELECTOR
        self.isvcs = Informers(kube_api, api.API_VERSION, api.PLURAL, ns, on_event=self._isvc_event)
        self.slices = Informers(kube_api, "discovery.k8s.io/v1", "endpointslices", ns, label_selector=managed,
                                index=_slice_service)
        self.wakes = Informers(kube_api, "v1", "configmaps", ns, on_event=self._wake_event,
                               label_selector=f"{managed},{render.L_COMPONENT}=wake")
        if not self.leadership.standalone:
            self.peerings = (Informers(kube_api, "kopf.dev/v1", "clusterkopfpeerings", on_event=self._changed_event)
                             if self.peering_clusterwide else
                             Informers(kube_api, "kopf.dev/v1", "kopfpeerings", ns, on_event=self._changed_event))
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        caches = [self.isvcs, self.slices, self.wakes, *([self.peerings] if self.peerings else [])]
        for informer in (i for group in caches for i in group.all):
            self._tasks.append(asyncio.create_task(informer.run(self.session), name=f"informer {informer.path}"))
        self._tasks.append(asyncio.create_task(self.supervise(), name="autoscaler"))

    async def close(self) -> None:
        await self._stop_loops(list(self.loops))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None
        M_LEADING.set(0)

    def leading(self) -> bool:
        return self.leadership.leading(self.peerings.values() if self.peerings else ())

    async def supervise(self) -> None:
        """One loop per autoscaled InferenceService while this replica leads; none while it stands by."""
        assert self.isvcs is not None
        await self.isvcs.wait_synced()
        was_leading = None
        while True:
            try:
                was_leading = await self._supervise_once(was_leading)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - never let one bad pass end autoscaling for good
                logger.exception("autoscaler supervisor")
            try:  # changes of the services or the peering wake us; time alone can end a peer's lease
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def _supervise_once(self, was_leading: bool | None) -> bool:
        """Start and stop the loops to match (leading, the autoscaled services); -> whether this replica leads."""
        self._changed.clear()
        leading = self.leading()
        if leading != was_leading:
            logger.info("autoscaler %s", "leading: scaling autoscaled services" if leading else
                        "standing by (another operator replica leads)")
            M_LEADING.set(1 if leading else 0)
        wanted = set()
        if leading:
            for isvc in self.isvcs.values():
                meta = isvc["metadata"]
                if autoscaled(isvc.get("spec") or {}) and not meta.get("deletionTimestamp"):
                    wanted.add((meta["namespace"], meta["name"]))
        for key in wanted - set(self.loops):
            stop = asyncio.Event()
            self.loops[key] = Loop(asyncio.create_task(self.run(key, stop), name=f"autoscale {key}"), stop)
        gone = [key for key in self.loops if key not in wanted]
        if gone:
            await self._stop_loops(gone)
            if leading:  # spec.autoscaling removed: replicas are the user's again
                for key in gone:
                    isvc = self.isvcs.get(*key)
                    if isvc is not None and not isvc["metadata"].get("deletionTimestamp"):
                        await self._forget(isvc)
        return leading

    async def _stop_loops(self, keys: list[tuple[str, str]]) -> None:
        loops = [self.loops.pop(key) for key in keys if key in self.loops]
        for loop in loops:
            loop.stop.set()
        if loops:
            _, pending = await asyncio.wait([lp.task for lp in loops], timeout=STOP_GRACE)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _changed_event(self, _kind: str, _obj: dict[str, Any]) -> None:
        self._changed.set()

    def _isvc_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace"), meta.get("name"))
        if kind == "DELETED":
            self.states.pop(key, None)
        elif (state := self.states.get(key)) is not None and state.generation != meta.get("generation"):
            state.generation = meta.get("generation")
            state.respec.set()
        self._changed.set()

    def _wake_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(render.L_ISVC)
        if kind != "DELETED" and owner:
            self.notice((meta.get("namespace"), owner), (meta.get("annotations") or {}).get(A_WAKE))

    def notice(self, key: tuple[str, str], wake: str | None) -> None:
        """Called on every event of an InferenceService's wake-up ConfigMap with its wake annotation: wake the
        loop when the gateway asked for capacity."""
        state = self.states.setdefault(key, State())
        if wake and wake != state.woken_at:
            first_sight = state.woken_at is None
            state.woken_at = wake
            if not first_sight or _recent(wake):
                state.wake.set()

    async def run(self, key: tuple[str, str], stop: asyncio.Event) -> None:
        """The loop of one InferenceService, until the supervisor stops it (autoscaling removed, the service
        deleted, or this replica no longer leads)."""
        state = self.states.setdefault(key, State())
        state.history, state.last_status = History(), None  # a new leader starts with no history
        state.prefill_history, state.prefill_last_status = History(), None
        state.generation = ((self.isvcs.get(*key) if self.isvcs else None) or {}).get("metadata", {}).get("generation")
        if state.woken_at is not None and not _recent(state.woken_at):
            state.wake.clear()  # noticed while standing by, long ago: not a request waiting now
        logger.info("autoscaling %s/%s", *key)
        try:
            while not stop.is_set():
                isvc = self.isvcs.get(*key) if self.isvcs else None
                if isvc is None:
                    break
                woken = state.wake.is_set()
                state.wake.clear()
                state.respec.clear()
                try:
                    await self.tick(isvc, state, woken)
                except asyncio.CancelledError:
                    raise
                except api.SpecError as e:  # the reconciler reports it on the status; said once per generation
                    seen = (*key, isvc["metadata"].get("generation"))
                    if seen not in self.invalid_seen:
                        self.invalid_seen.add(seen)
                        logger.warning("autoscaling %s/%s paused: invalid spec (%s)", *key, e)
                except Exception as e:  # API or scrape trouble: try again on the next tick
                    logger.warning("autoscaling %s/%s: %s", *key, e)
                waits = [asyncio.ensure_future(e.wait()) for e in (state.wake, state.respec, stop)]
                try:
                    await asyncio.wait(waits, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            for task in state.waking.values():  # a new leader reads what woke from /is_sleeping
                task.cancel()
            state.waking.clear()
            logger.info("autoscaling of %s/%s stopped", *key)
            for gauge in PER_SERVICE:
                try:
                    gauge.remove(*key)
                except KeyError:
                    pass

    async def _forget(self, isvc: dict[str, Any]) -> None:
        """spec.autoscaling was removed (or went external): replicas are spec.replicas again; say so by dropping
        what we reported. The conditions list is written whole, so on the version it was read from (a 409: read
        again and retry)."""
        meta = isvc["metadata"]
        for attempt in range(3):
            status = isvc.get("status") or {}
            if "autoscaling" not in status and not any(c.get("type") == CONDITION
                                                       for c in status.get("conditions") or []):
                return
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != CONDITION]
            try:
                await self.kube.merge_patch(api.KIND, meta["namespace"], meta["name"],
                                            {"metadata": {"resourceVersion": isvc["metadata"].get("resourceVersion")},
                                             "status": {"autoscaling": None, "conditions": conditions}},
                                            subresource="status")
                return
            except ApiError as e:
                if e.status != 409 or attempt == 2:
                    logger.info("autoscaling of %s/%s stopped; status not cleaned (%s)", meta["namespace"],
                                meta["name"], e)
                    return
            try:
                isvc = await self.kube.get(api.KIND, meta["namespace"], meta["name"])
            except ApiError:
                return

    # ---- observe ---------------------------------------------------------------------------------------------
    async def _get(self, url: str, read: Callable[[aiohttp.ClientResponse], Awaitable[Any]]) -> Any:
        """GET `url` in one of the scrape slots (its timeout starts once the slot is ours): `read(response)` when
        it answers 200; None when it answers otherwise, fails or times out."""
        if self._scrape_slots is None:
            self._scrape_slots = asyncio.Semaphore(self.max_concurrent_scrapes)
        async with self._scrape_slots:
            try:
                async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)) as r:
                    return await read(r) if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
                return None

    async def _scrape(self, url: str, target: str) -> str | None:
        text = await self._get(url + "/metrics", aiohttp.ClientResponse.text)
        M_SCRAPES.labels(target, "ok" if text is not None else "failed").inc()
        return text

    async def _scrape_engine(self, url: str, may_skip: bool) -> str | None:
        """An engine's /metrics; with `may_skip` (the gateways cover it) an engine that failed repeatedly is
        tried again only after a backoff, doubling up to ENGINE_BACKOFF_MAX."""
        failures, next_try = self.failing.get(url, (0, 0.0))
        if may_skip and time.monotonic() < next_try:
            M_SCRAPES.labels("engine", "skipped").inc()
            return None
        text = await self._scrape(url, "engine")
        if text is not None:
            self.failing.pop(url, None)
        else:
            failures += 1
            delay = 0.0 if failures < 2 else min(2.0 ** (failures - 1), ENGINE_BACKOFF_MAX)
            self.failing[url] = (failures, time.monotonic() + delay)
        return text

    def _endpoints(self, namespace: str, service: str, port_name: str | None = None) -> list[Endpoint]:
        return endpoints(self.slices.by_index((namespace, service), namespace), port_name) if self.slices else []

    async def observe(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, woken: bool,
                      state: State | None = None) -> Observation:
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        source = spec.autoscaling.load_source
        engines = self._endpoints(ns, engine_service(name, spec))
        gw_service = gateway_service(name, spec)
        # the gateways' metrics listener, which a mesh leaves out of its mTLS (render.GATEWAY_METRICS_PORT)
        gateways = self._endpoints(ns, gw_service, "metrics") if gw_service else []
        may_skip = source == "auto" and bool(gateways)
        scrape_engines = [self._scrape_engine(e.url, may_skip) for e in engines] if source != "gateways" else []
        scraped = await asyncio.gather(*scrape_engines, *(self._scrape(g.url, "gateway") for g in gateways))
        engine_texts = scraped[:len(scrape_engines)] or [None] * len(engines)
        gateway_texts = scraped[len(scrape_engines):]
        views = [gateway_view(t) for t in gateway_texts if t is not None]
        replicas, unknown = engine_loads(spec, engines, engine_texts, views, source)
        unknown += sum(1 for g, t in zip(gateways, gateway_texts) if t is None and g.ready)  # held: unknown
        pods = api.running_replicas(spec, isvc.get("status"))
        asleep: tuple[str, ...] = ()
        if state is not None and sleeps(spec):
            asleep = await self._observe_sleep(ns, engines, state)
            asleep = asleep[:pods]  # a rollout's surplus pods are not parked replicas
        current = pods - len(asleep)  # the awake replicas: what the decision scales
        ready = min(sum(1 for e in engines if e.ready and (e.pod or e.url) not in asleep), current)
        return Observation(now=time.monotonic(), current=current, ready=ready, replicas=tuple(replicas),
                           held=int(sum(v.held for v in views)), wake=woken and ready == 0, unanswered=unknown,
                           asleep=asleep, batch_pending=int(sum(v.batch_pending for v in views)))

    async def _is_sleeping(self, url: str) -> int | None:
        """An engine's sleep level from its /is_sleeping (0: awake); None when it did not say (loading, gone)."""
        body = await self._get(url + "/is_sleeping", aiohttp.ClientResponse.json)
        if not isinstance(body, dict):
            return None
        return int(body.get("level") or 1) if body.get("is_sleeping") else 0

    async def _observe_sleep(self, namespace: str, engines: list[Endpoint], state: State) -> tuple[str, ...]:
        """The pods whose engine is asleep, read from every engine's /is_sleeping on each decision (never kept
        only in memory: an operator restart, a new leader, a wake-up by the gateway all read the truth), and
        mirrored on the pods as the A_SLEEPING annotation, which the reconciler's status reads."""
        live = [e for e in engines if not e.terminating and e.pod]
        levels = await asyncio.gather(*(self._is_sleeping(e.url) for e in live))
        state.urls = {e.pod: e.url for e in live}
        for e, level in zip(live, levels):
            if level is None:
                continue
            want = str(level) if level else None
            if state.marked.get(e.pod, "unknown") != want:
                try:
                    await self.kube.merge_patch("Pod", namespace, e.pod,
                                                {"metadata": {"annotations": {A_SLEEPING: want}}})
                    state.marked[e.pod] = want
                except ApiError as err:
                    if err.status != 404:
                        logger.warning("%s/%s: could not mark it %s: %s", namespace, e.pod,
                                       "asleep" if want else "awake", err)
        return tuple(sorted(e.pod for e, level in zip(live, levels) if level))

    # ---- decide and act --------------------------------------------------------------------------------------
    async def observe_prefill(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec,
                              decode: Observation | None) -> Observation:
        """The prefill role's load: its engines' /metrics (the `<name>-prefill` Service's endpoints; for one that
        does not answer, a gateway's polled gauges of it unless loadSource is engines), and while none of them is
        ready the prompt tokens the decode engines wait to prefill themselves (from `decode`, the decode
        observation, when there is one; else scraped here)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        source = spec.autoscaling.load_source if spec.autoscaling is not None else "auto"
        engines = self._endpoints(ns, render.prefill_name(name))
        texts = await asyncio.gather(*(self._scrape(e.url, "engine") for e in engines)) if source != "gateways" \
            else [None] * len(engines)
        views: list[GatewayView] = []
        if source != "engines" and any(t is None for t in texts):  # the gateways may have polled those engines
            gateways = self._endpoints(ns, name, "metrics")
            views = [gateway_view(t) for t in await asyncio.gather(*(self._scrape(g.url, "gateway") for g in gateways))
                     if t is not None]
        replicas, unknown = engine_loads(spec, engines, list(texts), views, source, polled_only=True)
        current = api.running_prefill_replicas(spec, isvc.get("status"))
        ready = min(sum(1 for e in engines if e.ready), current)
        fallback = 0
        if ready == 0:  # the gateway has no prefill engine: the decode engines prefill themselves
            if decode is None:
                decoders = [e for e in self._endpoints(ns, engine_service(name, spec)) if e.ready]
                loads, _ = engine_loads(spec, decoders, list(await asyncio.gather(
                    *(self._scrape(e.url, "engine") for e in decoders))), [], "engines")
            else:
                loads = list(decode.replicas)
            fallback = sum(r.waiting_prefill_tokens for r in loads)
        return Observation(now=time.monotonic(), current=current, ready=ready, replicas=tuple(replicas),
                           unanswered=unknown, fallback_prefill_tokens=fallback)

    async def tick(self, isvc: dict[str, Any], state: State, woken: bool = False) -> Decision:
        """One decision for each autoscaled role: the prefill role (spec.prefill.autoscaling) on its own signal,
        then the replicas (spec.autoscaling); -> the replicas' decision (the prefill role's when only it is)."""
        started = time.perf_counter()
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        spec = self.spec_of(isvc)
        obs = await self.observe(isvc, spec, woken, state) if spec.autoscaling is not None else None
        prefill = None
        if spec.prefill is not None and spec.prefill.autoscaling is not None:
            isvc, prefill = await self.tick_prefill(isvc, spec, state, obs)
        if obs is None:  # only the prefill role is autoscaled: the replicas are spec.replicas
            await self._forget(isvc)
            M_DECISION_SECONDS.labels(ns, name).observe(time.perf_counter() - started)
            assert prefill is not None
            return prefill
        return await self.tick_replicas(isvc, spec, state, obs, started)

    async def tick_prefill(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, state: State,
                           decode: Observation | None) -> tuple[dict[str, Any], Decision]:
        """Decide the prefill count apart from the replicas' (its own policy, history and observation), write it
        to status.prefill.desiredReplicas (the reconciler renders the prefill Deployment from it) and report;
        -> (the InferenceService as now stored, the decision)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        obs = await self.observe_prefill(isvc, spec, decode)
        decision = decide(obs, prefill_policy_of(spec), state.prefill_history)
        logger.debug("%s/%s prefill: %s -> %s", ns, name, obs, decision)
        for gauge, value in ((M_PREFILL_DESIRED, decision.desired), (M_PREFILL_NEEDED, decision.needed),
                             (M_PREFILL_TOKENS, obs.waiting_prefill_tokens)):
            gauge.labels(ns, name).set(value)
        if decision.desired != obs.current:
            isvc = await self.scale_prefill(isvc, spec, obs, decision, state) or isvc
        isvc = await self.report_prefill(isvc, obs, decision, state) or isvc
        return isvc, decision

    async def scale_prefill(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, obs: Observation,
                            decision: Decision, state: State) -> dict[str, Any] | None:
        """Write the prefill count (status.prefill.desiredReplicas) on the view it was decided on; the least busy
        prefill pods are marked to go first. -> the updated InferenceService, None when the count moved meanwhile."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        current, target = obs.current, decision.desired
        if target < current:
            await self._mark_victims(ns, list(obs.replicas), current - target)
        scale_time = _now()
        patch: dict[str, Any] = {"status": {"prefill": {"desiredReplicas": target, "lastScaleTime": scale_time}}}
        updated = None
        for attempt in range(2):
            patch["metadata"] = {"resourceVersion": isvc["metadata"].get("resourceVersion")}
            try:
                updated = await self.kube.merge_patch(api.KIND, ns, name, patch, subresource="status")
                break
            except ApiError as e:
                if e.status != 409 or attempt:
                    raise
            isvc = await self.kube.get(api.KIND, ns, name)
            if api.running_prefill_replicas(spec, isvc.get("status")) != current:
                return None
        if updated is None:
            return None
        state.prefill_last_scale_time = scale_time
        M_SCALINGS.labels(ns, name, "Prefill" + decision.reason).inc()
        verb = "PrefillScaledUp" if target > current else "PrefillScaledDown"
        await self.kube.event(updated, "Normal", verb, f"prefill replicas {current} -> {target} ({decision.reason}): "
                                                       f"{decision.message}")
        logger.info("%s/%s: prefill replicas %d -> %d (%s): %s", ns, name, current, target, decision.reason,
                    decision.message)
        return updated

    async def report_prefill(self, isvc: dict[str, Any], obs: Observation, decision: Decision,
                             state: State) -> dict[str, Any] | None:
        """status.prefill's autoscaler fields: written when the decision changes, else every STATUS_REFRESH seconds
        while its inputs move. -> the updated InferenceService when written."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        key = (decision.desired, decision.reason, decision.needed, obs.current, obs.ready)
        inputs = {"inFlight": obs.in_flight, "held": 0, "kvCacheUsage": round(obs.kv_sum, 3),
                  "waitingPrefillTokens": obs.waiting_prefill_tokens, "ready": obs.ready, "starting": obs.starting}
        old = (isvc.get("status") or {}).get("prefill") or {}
        if key == state.prefill_last_status and (old.get("inputs") == inputs or
                                                 time.monotonic() - state.prefill_last_status_time < STATUS_REFRESH):
            return None
        status = {"prefill": {
            "desiredReplicas": decision.desired, "neededReplicas": decision.needed, "reason": decision.reason,
            "message": decision.message[:4096], "lastDecisionTime": _now(),
            "lastScaleTime": state.prefill_last_scale_time or old.get("lastScaleTime"), "inputs": inputs}}
        patch = {"metadata": {"resourceVersion": isvc["metadata"].get("resourceVersion")}, "status": status}
        try:
            updated = await self.kube.merge_patch(api.KIND, ns, name, patch, subresource="status")
        except ApiError as e:
            if e.status not in (404, 409):
                raise
            return None
        state.prefill_last_status, state.prefill_last_status_time = key, time.monotonic()
        return updated

    async def tick_replicas(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, state: State,
                            obs: Observation, started: float) -> Decision:
        meta = isvc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        policy = policy_of(spec)
        decision = decide(obs, policy, state.history)
        logger.debug("%s/%s: %s -> %s", ns, name, obs, decision)
        M_DECISION_SECONDS.labels(ns, name).observe(time.perf_counter() - started)
        for gauge, value in ((M_DESIRED, decision.desired), (M_CURRENT, obs.current), (M_READY, obs.ready),
                             (M_STARTING, obs.starting), (M_NEEDED, decision.needed), (M_IN_FLIGHT, obs.in_flight),
                             (M_HELD, obs.held), (M_KV, obs.kv_sum), (M_PREFILL, obs.waiting_prefill_tokens),
                             (M_UNKNOWN, obs.unanswered), (M_SLEEPING, len(obs.asleep))):
            gauge.labels(ns, name).set(value)
        if spec.autoscaling.autoscaler_class == "external":  # an HPA or KEDA acts on the metrics above
            await self._forget(isvc)
            return decision
        target = decision.desired
        if sleeps(spec):  # the decision counts awake replicas: park or wake engines, keep their pods
            parking = park(obs, decision.desired)
            if obs.current == 0 and parking.wake:  # the gateway's to do first (GATEWAY_WAKE_HEAD_START)
                state.zero_need_since = state.zero_need_since or obs.now
                if obs.now - state.zero_need_since < GATEWAY_WAKE_HEAD_START:
                    parking = Parking(pods=parking.pods)
            else:
                state.zero_need_since = None
            await self.act_on_sleep(isvc, spec, parking, state)
            target = parking.pods
        if target != obs.pods:
            isvc = await self.scale(isvc, spec, obs, decision, state, target) or isvc
        await self.report(isvc, obs, decision, state, target)
        return decision

    async def act_on_sleep(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, parking: Parking,
                           state: State) -> None:
        """POST /sleep to the idle engines to park (awaited: seconds), POST /wake_up to the parked ones to wake (in
        the background: level 2 reads the weights again; the next decisions see them awake through /is_sleeping
        and count them as starting until Ready)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        level = spec.autoscaling.sleep_level
        parked = []
        for pod in parking.sleep:
            url = state.urls.get(pod)
            if url and await self._post(url, f"/sleep?level={level}", SLEEP_TIMEOUT, f"{ns}/{pod}"):
                parked.append(pod)
        if parked:
            await self.kube.event(isvc, "Normal", "ParkedAsleep",
                                  f"idle: engine(s) of {', '.join(parked)} put to sleep at level {level} "
                                  "(pods kept; the gateway wakes one on the next request)")
            logger.info("%s/%s: parked asleep (level %d): %s", ns, name, level, ", ".join(parked))
        for pod in parking.wake:
            url = state.urls.get(pod)
            task = state.waking.get(pod)
            if url and (task is None or task.done()):
                state.waking[pod] = asyncio.create_task(
                    self._post(url, "/wake_up", float(spec.probes.startup_timeout_seconds), f"{ns}/{pod}"),
                    name=f"wake {ns}/{pod}")
                await self.kube.event(isvc, "Normal", "WakingUp", f"waking the engine of {pod} for the load")
                logger.info("%s/%s: waking %s", ns, name, pod)

    async def _post(self, url: str, path: str, timeout: float, what: str) -> bool:
        """An engine admin call: True when it answered 200. Anything else (409 requests in flight, 400 already so,
        unreachable) is logged and decided again on the next tick, from what /is_sleeping says then."""
        try:
            async with self.session.post(url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status == 200:
                    return True
                text = (await r.text())[:300]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            text = repr(e)
        logger.info("%s: POST %s not done (%s)", what, path, text)
        return False

    async def scale(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, obs: Observation,
                    decision: Decision, state: State, target: int) -> dict[str, Any] | None:
        """Write the new pod count `target`; -> the updated InferenceService, or None when the count it was decided
        on is no longer current (another operator replica scaled meanwhile: decide again on the next tick)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        current = obs.pods
        if target < current and spec.pods_per_replica(self.max_gpus_per_node) == 1:
            await self._mark_victims(ns, list(obs.replicas), current - target, obs.asleep)
        scale_time = _now()
        # The count lives in the status (the reconciler follows it), never in spec.replicas, the manifest's field.
        patch = {"status": {"autoscaling": {"desiredReplicas": target, "lastScaleTime": scale_time}}}
        updated = None
        for attempt in range(2):
            # resourceVersion: only on the view the decision was made on
            patch["metadata"] = {"resourceVersion": isvc["metadata"].get("resourceVersion")}
            try:
                updated = await self.kube.merge_patch(api.KIND, ns, name, patch, subresource="status")
                break
            except ApiError as e:
                if e.status != 409 or attempt:
                    raise
            isvc = await self.kube.get(api.KIND, ns, name)  # newer than the cache: did the count move?
            if api.running_replicas(spec, isvc.get("status")) != current:
                logger.info("%s/%s: replicas changed under this decision (%d -> %d); deciding again", ns, name,
                            current, target)
                return None
        if updated is None:
            return None
        state.last_scale_time = scale_time
        M_SCALINGS.labels(ns, name, decision.reason).inc()
        verb = "ScaledUp" if target > current else "ScaledDown"
        await self.kube.event(updated, "Normal", verb, f"replicas {current} -> {target} ({decision.reason}): "
                                                       f"{decision.message}")
        logger.info("%s/%s: replicas %d -> %d (%s): %s", ns, name, current, target, decision.reason,
                    decision.message)
        return updated

    async def _mark_victims(self, namespace: str, replicas: list[ReplicaLoad], count: int,
                            keep: tuple[str, ...] = ()) -> None:
        """Pod deletion costs from the in-flight counts: the ReplicaSet removes the cheapest pods first (parked
        ones, `keep`, last)."""
        order = pick_victims(replicas, len(replicas), keep)
        victims = set(order[:count])
        for rank, pod in enumerate(order):
            cost = -1000 + rank if pod in victims else rank
            try:
                await self.kube.merge_patch("Pod", namespace, pod,
                                            {"metadata": {"annotations": {A_DELETION_COST: str(cost)}}})
            except ApiError as e:
                if e.status != 404:
                    raise

    async def report(self, isvc: dict[str, Any], obs: Observation, decision: Decision, state: State,
                     target: int | None = None) -> None:
        """status.autoscaling and the Autoscaling condition: written when the decision changes, else every
        STATUS_REFRESH seconds while its inputs move (not once a second)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        target = decision.desired if target is None else target
        key = (target, decision.reason, decision.needed, obs.pods, obs.ready, len(obs.asleep))
        inputs = {"inFlight": obs.in_flight, "held": obs.held, "kvCacheUsage": round(obs.kv_sum, 3),
                  "waitingPrefillTokens": obs.waiting_prefill_tokens, "ready": obs.ready, "starting": obs.starting}
        old = (isvc.get("status") or {}).get("autoscaling") or {}
        if key == state.last_status and (old.get("inputs") == inputs or
                                         time.monotonic() - state.last_status_time < STATUS_REFRESH):
            return
        now = _now()
        conditions = [c for c in (isvc.get("status") or {}).get("conditions") or [] if c.get("type") != CONDITION]
        prev = next((c for c in (isvc.get("status") or {}).get("conditions") or [] if c.get("type") == CONDITION),
                    None)
        limited = decision.reason == "LimitedByMaxReplicas"
        cond_status = "False" if limited else "True"
        conditions.append({
            "type": CONDITION, "status": cond_status, "reason": decision.reason,
            "message": f"the autoscaler owns the replica count (status.autoscaling.desiredReplicas; spec.replicas "
                       f"is ignored): {decision.message}"[:32000],
            "lastTransitionTime": prev["lastTransitionTime"] if prev and prev.get("status") == cond_status
            and prev.get("lastTransitionTime") else now,
            "observedGeneration": isvc["metadata"].get("generation"),
        })
        status = {"autoscaling": {
            "currentReplicas": obs.pods, "desiredReplicas": target, "neededReplicas": decision.needed,
            "reason": decision.reason, "message": decision.message[:4096], "lastDecisionTime": now,
            "lastScaleTime": state.last_scale_time or old.get("lastScaleTime"), "inputs": inputs,
            "sleepingReplicas": len(obs.asleep) if sleeps(self.spec_of(isvc)) else None,
        }, "conditions": conditions}
        # resourceVersion: never write back conditions older than the reconciler's (409 -> next tick)
        patch = {"metadata": {"resourceVersion": isvc["metadata"].get("resourceVersion")}, "status": status}
        try:
            await self.kube.merge_patch(api.KIND, ns, name, patch, subresource="status")
        except ApiError as e:
            if e.status not in (404, 409):
                raise
            return
        state.last_status, state.last_status_time = key, time.monotonic()


# ------------------------------------------------------------------------------------------------ kopf handlers
# Only the operator's startup and cleanup: the autoscaler watches and decides on its own (see "Lead" above).
@kopf.on.startup()
async def start_autoscaler(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "autoscaler" not in memo:
        peering = settings.peering
        memo.autoscaler = Autoscaler(
            kube=Kube.from_environment(),
            leadership=Leadership(standalone=peering.standalone, peering_name=peering.name,
                                  priority=peering.priority, mandatory=peering.mandatory),
            peering_clusterwide=peering.clusterwide, namespaces=watched_namespaces(),
            max_gpus_per_node=int(os.environ.get("SHOAL_MAX_GPUS_PER_NODE") or 8),
            max_concurrent_scrapes=int(os.environ.get("SHOAL_MAX_CONCURRENT_SCRAPES") or MAX_CONCURRENT_SCRAPES))
        await memo.autoscaler.start()
    port = os.environ.get("SHOAL_METRICS_PORT")
    if port and "metrics_server" not in memo:
        from prometheus_client import start_http_server

        memo.metrics_server = start_http_server(int(port), registry=REGISTRY)
        logger.info("shoal:autoscaler_* metrics on :%s/metrics", port)


@kopf.on.cleanup()
async def stop_autoscaler(memo: kopf.Memo, **_: Any) -> None:
    autoscaler: Autoscaler | None = memo.get("autoscaler")
    if autoscaler is not None:
        await autoscaler.close()
        await autoscaler.kube.close()
    server = memo.get("metrics_server")
    if server is not None:
        server[0].shutdown()
