"""The autoscaling loop: for every InferenceService with `spec.autoscaling`, observe the load every second (or at
once when the gateway asks), decide (autoscaling.decide) and set the replica count,
`status.autoscaling.desiredReplicas` (spec.replicas stays the user's manifest: a re-applied manifest or a GitOps
sync does not fight the autoscaler).

Observe
    The engine Service's EndpointSlices say where every serving pod is (address, port, pod name, ready or not);
    each engine's /metrics gives running/waiting requests, KV-cache usage and prompt tokens waiting for prefill;
    the gateway's /metrics (its own Service's EndpointSlices) gives the requests it holds while no engine is
    ready. Scrapes time out after 0.5 s; a Ready pod that does not answer is unknown load (never idleness).
Wake-up
    A gateway that starts holding a request while no engine is ready annotates its wake-up ConfigMap
    (`<name>-wake`, the one object it may patch) with `serving.shoal.dev/wake-requested-at` (a merge patch, at
    most once a second). The annotation goes through the API server, so it reaches whichever operator replica
    leads and survives an operator restart; the operator's watch sees it within milliseconds and decides at once
    instead of on the next tick. An annotation seen for the
    first time (an operator restart, a new leader) wakes only if it is recent: one left from a past wake-up must
    not start a replica; requests that are really waiting show in the gateway's held count anyway.
Act
    Scale-up and scale-down patch `status.autoscaling.desiredReplicas`, which the reconciler renders the
    Deployment (or the groups) from; spec.replicas is only where a new fleet starts. Before a
    scale-down of a Deployment the pods are annotated with `controller.kubernetes.io/pod-deletion-cost` from
    their in-flight counts, so the ReplicaSet removes the least busy ones. Removal then drains without cutting
    streams: the terminating pod's endpoint turns not-ready (the gateway sends it nothing new), the engine's
    SIGTERM handler finishes its in-flight requests within `engine.shutdownTimeoutSeconds`, and the pod's grace
    period is longer than that drain.
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
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from shoal.engine.gateway import metric_names
from shoal.operator import api, render
from shoal.operator.autoscaling import Decision, History, Observation, Policy, ReplicaLoad, decide, pick_victims
from shoal.operator.kube import ApiError, Kube

logger = logging.getLogger("shoal.operator.autoscaler")

A_WAKE = "serving.shoal.dev/wake-requested-at"
A_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
L_SERVICE_NAME = "kubernetes.io/service-name"
INTERVAL = 1.0  # seconds between decisions without a wake-up
SCRAPE_TIMEOUT = 0.5
STATUS_REFRESH = 15.0  # rewrite status.autoscaling at most this often when only the inputs moved
WAKE_FRESH = 30.0  # seconds: a wake-up annotation seen for the first time counts only if this recent
CONDITION = "Autoscaling"

REGISTRY = CollectorRegistry(auto_describe=False)
_L = ["namespace", "name"]
M_DESIRED = Gauge("shoal:autoscaler_desired_replicas", "Replicas the autoscaler wants.", _L, registry=REGISTRY)
M_CURRENT = Gauge("shoal:autoscaler_current_replicas", "Replicas running when the autoscaler last looked.", _L,
                  registry=REGISTRY)
M_READY = Gauge("shoal:autoscaler_ready_replicas", "Replicas whose engine endpoint is ready.", _L, registry=REGISTRY)
M_NEEDED = Gauge("shoal:autoscaler_needed_replicas", "Replicas the load needs before stabilization and limits.", _L,
                 registry=REGISTRY)
M_IN_FLIGHT = Gauge("shoal:autoscaler_in_flight_requests", "Requests running or waiting on engines plus held.", _L,
                    registry=REGISTRY)
M_HELD = Gauge("shoal:autoscaler_held_requests", "Requests the gateways hold while no engine is ready.", _L,
               registry=REGISTRY)
M_KV = Gauge("shoal:autoscaler_kv_cache_usage", "KV-cache usage summed over serving engines.", _L, registry=REGISTRY)
M_SCALINGS = Counter("shoal:autoscaler_scalings", "Changes of the replica count made by the autoscaler, by reason.",
                     _L + ["reason"], registry=REGISTRY)
M_DECISION_SECONDS = Histogram("shoal:autoscaler_decision_seconds", "Time to observe and decide once.", _L,
                               buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5], registry=REGISTRY)


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
    return render.engines_service_name(name) if spec.gateway.enabled else name


def gateway_service(name: str, spec: api.InferenceServiceSpec) -> str | None:
    """The Service in front of the gateway pods, whose metrics report held requests (None: no gateway)."""
    return name if spec.gateway.enabled else None


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


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: sum over its label sets}."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


@dataclass(frozen=True)
class Endpoint:
    url: str
    pod: str | None
    ready: bool


def endpoints(slices: list[dict[str, Any]]) -> list[Endpoint]:
    """Every endpoint of these EndpointSlices (ready or not: a draining pod still carries requests)."""
    found = []
    for s in slices:
        ports = [p for p in s.get("ports") or [] if p.get("port") and p.get("protocol", "TCP") == "TCP"]
        if not ports:
            continue
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
            ref = ep.get("targetRef") or {}
            ready = (ep.get("conditions") or {}).get("ready") is not False
            found.append(Endpoint(f"http://{host}:{ports[0]['port']}", ref.get("name"), ready))
    return found


@dataclass
class State:
    """Per InferenceService, in the operator's memory."""

    history: History = field(default_factory=History)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    woken_at: str | None = None  # the last wake annotation value acted upon
    last_status: tuple | None = None
    last_status_time: float = 0.0
    last_scale_time: str | None = None


@dataclass
class Autoscaler:
    kube: Kube
    indexes: dict[str, Any] = field(default_factory=dict)  # kopf's isvc index, shared with the reconciler
    states: dict[tuple[str, str], State] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    interval: float = INTERVAL
    max_gpus_per_node: int = 8  # the operator's --max-gpus-per-node: specs validate as the reconciler's do
    invalid_seen: set[tuple[str, str, Any]] = field(default_factory=set)  # (ns, name, generation) logged invalid

    def spec_of(self, isvc: dict[str, Any]) -> api.InferenceServiceSpec:
        return api.validate(isvc["metadata"]["name"], isvc.get("spec"), max_gpus_per_node=self.max_gpus_per_node)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def notice(self, key: tuple[str, str], wake: str | None) -> None:
        """Called on every event of an InferenceService's wake-up ConfigMap with its wake annotation: wake the
        loop when the gateway asked for capacity."""
        state = self.states.setdefault(key, State())
        if wake and wake != state.woken_at:
            first_sight = state.woken_at is None
            state.woken_at = wake
            if not first_sight or _recent(wake):
                state.wake.set()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _isvc(self, key: tuple[str, str]) -> dict[str, Any] | None:
        found = list((self.indexes.get(api.KIND) or {}).get(key, []))
        return found[0] if found else None

    async def run(self, key: tuple[str, str], stopped: Any) -> None:
        """The loop of one InferenceService, as a kopf daemon: kopf starts it for every resource with
        spec.autoscaling, and stops it when the field goes, the resource is deleted, or this operator replica
        stops leading (peering: only the active replica scales)."""
        state = self.states.setdefault(key, State())
        logger.info("autoscaling %s/%s", *key)
        try:
            while not stopped:
                isvc = self._isvc(key)
                if isvc is None:
                    await asyncio.sleep(0.05)  # the index is filled before handlers run; deleted meanwhile
                    continue
                woken = state.wake.is_set()
                state.wake.clear()
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
                try:
                    await asyncio.wait_for(state.wake.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
            isvc = self._isvc(key)
            if isvc is not None and not (isvc.get("spec") or {}).get("autoscaling") and \
                    not isvc["metadata"].get("deletionTimestamp"):
                await self._forget(isvc)
        finally:
            logger.info("autoscaling of %s/%s stopped", *key)
            for g in (M_DESIRED, M_CURRENT, M_READY, M_NEEDED, M_IN_FLIGHT, M_HELD, M_KV):
                try:
                    g.remove(*key)
                except KeyError:
                    pass
            if self.states.get(key) is state:
                del self.states[key]

    async def _forget(self, isvc: dict[str, Any]) -> None:
        """spec.autoscaling was removed: replicas are the user's again; say so by dropping what we reported."""
        status = isvc.get("status") or {}
        if "autoscaling" not in status and not any(c.get("type") == CONDITION for c in status.get("conditions") or []):
            return
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != CONDITION]
        meta = isvc["metadata"]
        try:
            await self.kube.merge_patch(api.KIND, meta["namespace"], meta["name"],
                                        {"status": {"autoscaling": None, "conditions": conditions}},
                                        subresource="status")
        except ApiError as e:
            logger.info("autoscaling of %s/%s stopped; status not cleaned (%s)", meta["namespace"], meta["name"], e)

    # ---- observe ---------------------------------------------------------------------------------------------
    async def _scrape(self, url: str) -> dict[str, float] | None:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT))
        try:
            async with self.session.get(url + "/metrics") as r:
                if r.status != 200:
                    return None
                return metric_sums(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _endpoints(self, namespace: str, service: str) -> list[Endpoint]:
        slices = await self.kube.list("EndpointSlice", namespace, label_selector=f"{L_SERVICE_NAME}={service}")
        return endpoints(slices)

    async def observe(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, woken: bool) -> Observation:
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        engines = await self._endpoints(ns, engine_service(name, spec))
        gw_service = gateway_service(name, spec)
        gateways = await self._endpoints(ns, gw_service) if gw_service else []
        scraped = await asyncio.gather(*(self._scrape(e.url) for e in engines + gateways))
        names = metric_names.for_runtime(spec.runtime)  # vllm:num_requests_running for a vLLM fleet, ...
        replicas = []
        for ep, m in zip(engines, scraped[:len(engines)]):
            load = metric_names.load_from_sums(m or {}, names)
            replicas.append(ReplicaLoad(
                pod=ep.pod or ep.url, ready=ep.ready, running=int(load["running"]), waiting=int(load["waiting"]),
                kv_cache_usage=load["kv_usage"], waiting_prefill_tokens=int(load["waiting_prefill_tokens"])))
        held = sum(int((m or {}).get("shoal:gateway_held_requests", 0)) for m in scraped[len(engines):])
        current = api.running_replicas(spec, isvc.get("status"))
        ready = min(sum(1 for e in engines if e.ready), current)
        return Observation(now=time.monotonic(), current=current, ready=ready, replicas=tuple(replicas), held=held,
                           wake=woken and ready == 0,
                           # only Ready endpoints: one still starting or crash-looping serves nothing yet
                           unanswered=sum(1 for e, m in zip(engines + gateways, scraped) if m is None and e.ready))

    # ---- decide and act --------------------------------------------------------------------------------------
    async def tick(self, isvc: dict[str, Any], state: State, woken: bool = False) -> Decision:
        started = time.perf_counter()
        meta = isvc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        spec = self.spec_of(isvc)
        policy = policy_of(spec)
        obs = await self.observe(isvc, spec, woken)
        decision = decide(obs, policy, state.history)
        logger.debug("%s/%s: %s -> %s", ns, name, obs, decision)
        M_DECISION_SECONDS.labels(ns, name).observe(time.perf_counter() - started)
        for gauge, value in ((M_DESIRED, decision.desired), (M_CURRENT, obs.current), (M_READY, obs.ready),
                             (M_NEEDED, decision.needed), (M_IN_FLIGHT, obs.in_flight), (M_HELD, obs.held),
                             (M_KV, obs.kv_sum)):
            gauge.labels(ns, name).set(value)
        if decision.desired != obs.current:
            await self.scale(isvc, spec, obs, decision, state)
        await self.report(isvc, obs, decision, state)
        return decision

    async def scale(self, isvc: dict[str, Any], spec: api.InferenceServiceSpec, obs: Observation,
                    decision: Decision, state: State) -> None:
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        if decision.desired < obs.current and spec.pods_per_replica(self.max_gpus_per_node) == 1:
            await self._mark_victims(ns, list(obs.replicas), obs.current - decision.desired)
        state.last_scale_time = _now()
        # The count lives in the status (the reconciler follows it), never in spec.replicas, the manifest's field.
        await self.kube.merge_patch(api.KIND, ns, name, {"status": {"autoscaling": {
            "desiredReplicas": decision.desired, "lastScaleTime": state.last_scale_time}}}, subresource="status")
        M_SCALINGS.labels(ns, name, decision.reason).inc()
        verb = "ScaledUp" if decision.desired > obs.current else "ScaledDown"
        kopf.event({"apiVersion": api.API_VERSION, "kind": api.KIND,
                    "metadata": {"name": name, "namespace": ns, "uid": isvc["metadata"].get("uid")}},
                   type="Normal", reason=verb,
                   message=f"replicas {obs.current} -> {decision.desired} ({decision.reason}): {decision.message}")
        logger.info("%s/%s: replicas %d -> %d (%s): %s", ns, name, obs.current, decision.desired, decision.reason,
                    decision.message)

    async def _mark_victims(self, namespace: str, replicas: list[ReplicaLoad], count: int) -> None:
        """Pod deletion costs from the in-flight counts: the ReplicaSet removes the cheapest pods first."""
        order = pick_victims(replicas, len(replicas))
        victims = set(order[:count])
        for rank, pod in enumerate(order):
            cost = -1000 + rank if pod in victims else rank
            try:
                await self.kube.merge_patch("Pod", namespace, pod,
                                            {"metadata": {"annotations": {A_DELETION_COST: str(cost)}}})
            except ApiError as e:
                if e.status != 404:
                    raise

    async def report(self, isvc: dict[str, Any], obs: Observation, decision: Decision, state: State) -> None:
        """status.autoscaling and the Autoscaling condition: written when the decision changes, else every
        STATUS_REFRESH seconds while its inputs move (not once a second)."""
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        key = (decision.desired, decision.reason, decision.needed, obs.current, obs.ready)
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
            "currentReplicas": obs.current, "desiredReplicas": decision.desired, "neededReplicas": decision.needed,
            "reason": decision.reason, "message": decision.message[:4096], "lastDecisionTime": now,
            "lastScaleTime": state.last_scale_time or old.get("lastScaleTime"), "inputs": inputs,
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
@kopf.on.startup()
async def start_autoscaler(memo: kopf.Memo, **_: Any) -> None:
    if "autoscaler" not in memo:
        memo.autoscaler = Autoscaler(kube=Kube.from_environment(workers=4),
                                     max_gpus_per_node=int(os.environ.get("SHOAL_MAX_GPUS_PER_NODE") or 8))
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
        autoscaler.kube.close()
    server = memo.get("metrics_server")
    if server is not None:
        server[0].shutdown()


def _autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("autoscaling"))


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="autoscaler", when=_autoscaled,
             cancellation_backoff=INTERVAL + 0.5, cancellation_timeout=5.0)  # a tick ends, then the loop exits
async def autoscale(namespace: str, name: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                    inferenceservice_index: kopf.Index, **_: Any) -> None:
    """A kopf daemon (not a task of our own) so that kopf stops it when this operator replica pauses for a
    peer with a higher priority: only the leading replica scales. kopf puts a finalizer on autoscaled
    InferenceServices for it (removed when spec.autoscaling goes). kopf injects handlers.py's index of
    InferenceServices by its id."""
    autoscaler: Autoscaler = memo.autoscaler
    autoscaler.indexes[api.KIND] = inferenceservice_index
    await autoscaler.run((namespace, name), stopped)


@kopf.on.event("v1", "configmaps", labels={render.L_MANAGED_BY: render.MANAGED_BY, render.L_COMPONENT: "wake"})
async def wake_event(type: str | None, namespace: str, labels: dict, annotations: dict, memo: kopf.Memo,
                     **_: Any) -> None:
    """A wake-up annotation from a gateway (on the InferenceService's wake-up ConfigMap) makes the loop decide at
    once instead of on its next tick."""
    autoscaler: Autoscaler | None = memo.get("autoscaler")
    owner = labels.get(render.L_ISVC)
    if autoscaler is None or type == "DELETED" or not owner:
        return
    autoscaler.notice((namespace, owner), annotations.get(A_WAKE))
