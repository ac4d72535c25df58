"""The shared gateway's view of a fleet: every InferenceService of a namespace (or the cluster), one pool each,
and which pool serves which model name.

`shoal-gateway --namespace NS` (no --service, no --endpoint) is one OpenAI endpoint for many models: a request goes
to the InferenceService serving its `model`, as its base model (the served name) or as one of its LoRA adapters.
Two list-and-watch streams feed it (k8s.informer.Informer):

* InferenceServices: one pool per service (pool.py), configured from its spec — served name, runtime (readiness
  path and metric names), spec.priority, engine.maxNumSeqs (admission slots per engine), engine.schedulingPolicy,
  scale from zero (autoscaling.minReplicas 0: requests are held up to probes.startupTimeoutSeconds and the service's
  wake-up ConfigMap `<name>-wake` is annotated, as its own gateway does) — and the adapters spec.adapters names;
* the operator's EndpointSlices (label app.kubernetes.io/managed-by=shoal-operator, which the EndpointSlice
  controller copies from the Services): the Ready engines of `<name>-engines` (`<name>` when the service runs
  without its own gateway) are the pool's backends. With `--routing precise-prefix` the slices' `kv-events` and
  `kv-replay` ports (rendered when the engines publish, shoal-operator --shared-gateway-routing) say which engines
  publish KV events and where: each pool has its own KVIndex and subscribers (topic `kv@<namespace>/<name>`),
  opened and closed with it, and tokenizes prompts with its own engines' /tokenize (proxy.prompt_tokens). A
  service with spec.prefill also has its prefill engines (`<name>-prefill`'s slices): each completion's prefill goes
  there first, its decode to the pool's engine, as the service's own gateway does (disaggregation.py).

Model names come from the specs (the served name, spec.adapters), from each pool's engines' /v1/models (adapters
loaded at run time, with `parent`), polled every `models_interval` seconds, and — for an adapter loaded since the
last poll — from what each engine listed at its last poll (poller.py) or the residency its metrics report.

Names belong to their namespace (docs/gateway.md, "Tenancy"). A caller (a tenant: tenants.Caller) of namespace N
resolves a `model` in N first; only when N serves no such name, in the other namespaces whose InferenceServices
grant N (annotation `serving.shoal.dev/tenant-namespaces: "n1,n2"` or `"*"` on the service). A name that several
granting namespaces serve is refused (409 model_ambiguous), never silently pointed at one of them, so nothing
another namespace creates can capture what a tenant's `model` reaches. Within one namespace a name served by two
services goes to the one serving it as its base model, else to the oldest (a warning says so). A model the caller
may not use is answered exactly like an unknown one (404, naming nothing else). Everything waiting in a pool whose
service is deleted gets 404.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from dataclasses import dataclass, replace
from urllib.parse import quote
from typing import TYPE_CHECKING, Any

import aiohttp

from shoal.operator import contract
from shoal.operator.gateway.discovery import canary_percent, kv_event_ports, ready_urls, revisions
from shoal.operator.gateway.metric_names import BY_RUNTIME
from shoal.operator.gateway.pool import Pool
from shoal.operator.k8s.client import KubeAPI, collection_path
from shoal.operator.k8s.informer import Informer

if TYPE_CHECKING:
    from shoal.operator.gateway.proxy import Gateway

log = logging.getLogger("shoal.gateway.fleet")

# The InferenceService contract (operator/contract.py), which the operator renders by; not the spec's models.
ISVC_GROUP_VERSION = contract.API_VERSION
ISVC_PLURAL = contract.PLURAL
MANAGED_SELECTOR = contract.MANAGED_SELECTOR
SERVICE_NAME_LABEL = contract.L_SERVICE_NAME
DEFAULT_STARTUP_TIMEOUT = contract.DEFAULT_STARTUP_TIMEOUT_SECONDS  # how long a request waits at zero
# Set by a namespace's own users (RBAC: whoever may edit the InferenceService): the tenants' namespaces that may
# use this service's models besides its own, comma-separated, or "*" for every tenant.
GRANT_ANNOTATION = "serving.shoal.dev/tenant-namespaces"
# What an aggregated /v1/models card may say: never an engine's adapter path (vLLM's `root` of a LoRA card).
CARD_FIELDS = ("id", "object", "created", "owned_by", "parent", "max_model_len")


class ModelNotFound(LookupError):
    """No InferenceService the caller may use serves this model (404)."""


class ModelAmbiguous(LookupError):
    """Several namespaces granting the caller serve this name (409): none is chosen for it."""

    def __init__(self, model: str, namespaces: list[str]):
        super().__init__(f"the model `{model}` is served by namespaces {', '.join(namespaces)}, which all grant "
                         f"yours: ask their owners to rename it, or revoke a grant")
        self.namespaces = namespaces


def grants_of(meta: dict) -> frozenset[str]:
    text = (meta.get("annotations") or {}).get(GRANT_ANNOTATION) or ""
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class ServiceView:
    """What the shared gateway reads of one InferenceService."""

    namespace: str
    name: str
    served_name: str
    engine_service: str
    runtime: str = "shoal"
    priority: int = 0
    hold_timeout: float = 0.0
    wake_engines: bool = False  # autoscaling.scaleToZero sleep: a held request wakes a parked engine
    max_inflight: int = 0
    engine_priority: bool = False
    adapters: tuple[str, ...] = ()
    adapter_priorities: tuple[tuple[str, int], ...] = ()  # (name, priority) of adapters with their own
    created: str = ""
    grants: frozenset[str] = frozenset()  # tenant namespaces besides its own that may use it ("*": all)
    uid: str = ""
    prefill_service: str = ""  # spec.prefill's headless Service (its prefill engines), "" without spec.prefill

    def usable_by(self, namespace: str | None) -> bool:
        """May a caller of `namespace` use this service? None: the gateway authenticates nobody (one tenant)."""
        return namespace is None or namespace == self.namespace or "*" in self.grants or namespace in self.grants

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @classmethod
    def of(cls, obj: dict) -> "ServiceView":
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        name = meta["name"]
        model = spec.get("model") or {}
        uri = model.get("uri") or ""
        # the operator writes the contract's rule to status.servedModelName; before its first status, the same rule
        served = status.get("servedModelName") or contract.served_model_name(name, uri, model.get("servedName"))
        gateway = spec.get("gateway") or {}
        engine = spec.get("engine") or {}
        autoscaling = spec.get("autoscaling") or None
        from_zero = autoscaling is not None and _int(autoscaling.get("minReplicas"), 1) == 0
        runtime = spec.get("runtime") if spec.get("runtime") in BY_RUNTIME else "shoal"
        listed = [a for a in spec.get("adapters") or []
                  if isinstance(a, dict) and isinstance(a.get("name"), str) and a["name"]]
        adapters = tuple(a["name"] for a in listed)
        adapter_priorities = tuple((a["name"], a["priority"]) for a in listed
                                   if isinstance(a.get("priority"), int) and not isinstance(a["priority"], bool))
        return cls(
            namespace=meta.get("namespace") or "", name=name, served_name=served,
            engine_service=contract.serving_engines_service(name, gateway.get("enabled", True) is not False),
            runtime=runtime, priority=_int(spec.get("priority"), 0),
            hold_timeout=float(_int((spec.get("probes") or {}).get("startupTimeoutSeconds"),
                                    DEFAULT_STARTUP_TIMEOUT)) if from_zero else 0.0,
            wake_engines=from_zero and autoscaling.get("scaleToZero") == "sleep",
            max_inflight=_int(engine.get("maxNumSeqs"), 0),
            engine_priority=engine.get("schedulingPolicy") == "priority",
            adapters=adapters, adapter_priorities=adapter_priorities, created=meta.get("creationTimestamp") or "",
            grants=grants_of(meta), uid=meta.get("uid") or "",
            prefill_service=contract.prefill_name(name) if isinstance(spec.get("prefill"), dict) else "")

    def clamped(self, bound: int | None) -> "ServiceView":
        """The view with its priorities (the service's and its adapters') at most `bound` (None: unbounded)."""
        if bound is None:
            return self
        return replace(self, priority=min(self.priority, bound),
                       adapter_priorities=tuple((a, min(p, bound)) for a, p in self.adapter_priorities))


def _epoch(stamp: str) -> int:
    try:
        return int(datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


class Fleet:
    """Pools by InferenceService, and the model-name index over them."""

    shared = True

    def __init__(self, gateway: "Gateway", namespace: str | None, api: KubeAPI | None = None,
                 models_interval: float = 10.0, priority_bound=lambda namespace: None):
        self.gateway = gateway
        self.namespace = namespace  # None: every namespace
        self.api = api
        self.models_interval = models_interval
        self.views: dict[tuple[str, str], ServiceView] = {}
        self.pools: dict[tuple[str, str], Pool] = {}
        self.slices: dict[tuple[str, str], dict[str, dict]] = {}  # (namespace, service) -> slice name -> slice
        self.engine_models: dict[tuple[str, str], list[dict]] = {}  # the engines' /v1/models, per service
        self._models_polled: dict[tuple[str, str], float] = {}
        self._index: dict[str, dict[str, list[Pool]]] | None = None
        self._conflicts: set[tuple[str, str]] = set()
        self.tasks: list[asyncio.Task] = []
        self.priority_bound = priority_bound  # namespace -> the highest priority the platform allows it, or None
        self.reported: set[tuple] = set()  # clamps already reported as Events

    # ---- the index -------------------------------------------------------------------------------------------
    def _names(self, key: tuple[str, str]) -> list[tuple[str, bool]]:
        """(model name, is the base model) for everything the service serves that the gateway knows of."""
        view = self.views[key]
        names = [(view.served_name, True)] + [(a, False) for a in view.adapters]
        for card in self.engine_models.get(key, ()):
            if isinstance(card.get("id"), str) and card.get("parent"):
                names.append((card["id"], False))
        return names

    def index(self) -> dict[str, dict[str, list[Pool]]]:
        """model name -> namespace -> the pools of that namespace serving it, best first (the base model, then
        the oldest service). Name first: a lookup costs the namespaces serving that name, not all of them."""
        if self._index is None:
            ranked: dict[str, dict[str, list[tuple[tuple, Pool]]]] = {}
            for key, pool in self.pools.items():
                created = self.views[key].created or "~"
                for model, base in self._names(key):
                    ranked.setdefault(key[0], {}).setdefault(model, []).append(((not base, created, key), pool))
            self._index = {}
            for namespace, names in ranked.items():
                for model, pools in names.items():
                    pools.sort(key=lambda x: x[0])
                    unique = list(dict.fromkeys(p for _, p in pools))
                    if len(unique) > 1 and (namespace, model) not in self._conflicts:
                        self._conflicts.add((namespace, model))
                        log.warning("model %r is served by %s: routed to %s", model,
                                    ", ".join(p.key for p in unique), unique[0].key)
                    self._index.setdefault(model, {})[namespace] = unique
        return self._index

    def _changed(self) -> None:
        self._index = None

    def _usable(self, pool: Pool, namespace: str | None) -> bool:
        view = self.views.get((pool.namespace, pool.name))
        return view is not None and view.usable_by(namespace)

    def _candidates(self, model: str, namespace: str | None) -> dict[str, Pool]:
        """Per namespace, the pool a caller of `namespace` would get for `model` there."""
        found: dict[str, Pool] = {}
        for ns, pools in self.index().get(model, {}).items():
            usable = [p for p in pools if self._usable(p, namespace)]
            if usable:
                found[ns] = usable[0]
        if not found:  # an adapter loaded since the last /v1/models poll: the engines' metrics know it
            for p in self.pools.values():
                if p.namespace not in found and self._usable(p, namespace) and \
                        any(model in b.lora_resident or model in b.listed for b in p.backends.all()):
                    found[p.namespace] = p
        return found

    def resolve(self, model: str | None, namespace: str | None = None) -> Pool | None:
        """The pool serving `model` to a caller of `namespace`: its own namespace's first, else the one granting
        namespace that serves it; None when none may (ModelAmbiguous when several would)."""
        if not model:
            return None
        found = self._candidates(model, namespace)
        if namespace in found:
            return found[namespace]
        if len(found) > 1:
            raise ModelAmbiguous(model, sorted(found))
        return next(iter(found.values()), None)

    def all(self) -> list[Pool]:
        return list(self.pools.values())

    def usable(self, namespace: str | None) -> list[Pool]:
        """The pools a caller of `namespace` may use."""
        return [p for p in self.pools.values() if self._usable(p, namespace)]

    def models(self, namespace: str | None = None) -> list[dict]:
        """The aggregated /v1/models of a caller of `namespace`: each model it may use (as resolve() would route
        it; ambiguous names are left out), as its engines describe it when they answered, else from the spec —
        only CARD_FIELDS, never an adapter's path."""
        names = set(self.index())
        for pool in self.pools.values():
            for b in pool.backends.all():
                names.update(b.lora_resident)
                names.update(b.adapters or ())
        cards: list[dict] = []
        for model in sorted(names):
            try:
                pool = self.resolve(model, namespace)
            except ModelAmbiguous:
                continue
            if pool is None:
                continue
            key = (pool.namespace, pool.name)
            view = self.views[key]
            known = {c.get("id"): c for c in self.engine_models.get(key, ())}
            base = model == view.served_name
            card = {"id": model, "object": "model", "created": _epoch(view.created), "owned_by": "shoal",
                    "parent": None if base else view.served_name}
            card.update({k: v for k, v in known.get(model, {}).items() if k in CARD_FIELDS})
            card["root"] = model if card.get("parent") is None else card["parent"]
            cards.append(card)
        return cards

    # ---- InferenceServices -----------------------------------------------------------------------------------
    def apply(self, obj: dict) -> None:
        """An InferenceService was listed, added or changed."""
        try:
            view = ServiceView.of(obj)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring an InferenceService the gateway cannot read: %r", e)
            return
        if obj.get("metadata", {}).get("deletionTimestamp"):
            self.remove(view.key)
            return
        view = self._bounded(view)
        old = self.views.get(view.key)
        if old == view:
            return
        self.views[view.key] = view
        pool = self.pools.get(view.key)
        if pool is None or old is None or old.runtime != view.runtime:
            if pool is not None:
                self.gateway.close_pool(pool, ModelNotFound())
            pool = self.gateway.open_pool(view)
            self.pools[view.key] = pool
            log.info("serving %s from %s/%s", view.served_name, *view.key)
        else:
            self.gateway.configure_pool(pool, view)
        if old is None or (old.engine_service, old.prefill_service) != (view.engine_service, view.prefill_service):
            self._publish(view)
        self._changed()

    def _bounded(self, view: ServiceView) -> ServiceView:
        """spec.priority (and the adapters') capped by what the platform allows the namespace; a cap is reported
        once as a Warning Event on the InferenceService (`PriorityClamped`) and logged."""
        bound = self.priority_bound(view.namespace)
        asked = max([view.priority, *(p for _, p in view.adapter_priorities)])
        view = view.clamped(bound)
        if bound is not None and asked > bound and (view.key, view.uid, asked, bound) not in self.reported:
            self.reported.add((view.key, view.uid, asked, bound))
            message = (f"priority {asked} exceeds the highest namespace {view.namespace} may use ({bound}): the "
                       f"shared gateway ranks its requests at {bound}")
            log.warning("%s/%s: %s", *view.key, message)
            if self.gateway.session is not None and self.api is not None:
                task = asyncio.get_running_loop().create_task(self._event(view, "PriorityClamped", message))
                self.tasks.append(task)
                task.add_done_callback(lambda t: t in self.tasks and self.tasks.remove(t))
        return view

    async def _event(self, view: ServiceView, reason: str, message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{view.name}.", "namespace": view.namespace},
                "involvedObject": {"apiVersion": ISVC_GROUP_VERSION, "kind": "InferenceService",
                                   "namespace": view.namespace, "name": view.name, "uid": view.uid},
                "reason": reason, "message": message, "type": "Warning", "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "shoal-gateway"}}
        url = f"{self.api.server}/api/v1/namespaces/{quote(view.namespace)}/events"
        try:
            async with self.gateway.session.post(url, data=json.dumps(body), ssl=self.api.ssl_context,
                                                 headers={**self.api.headers(), "Content-Type": "application/json"},
                                                 timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status >= 300:
                    log.warning("cannot record the %s event of %s/%s: HTTP %d", reason, *view.key, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("cannot record the %s event of %s/%s: %r", reason, *view.key, e)

    def remove(self, key: tuple[str, str]) -> None:
        self.views.pop(key, None)
        self.engine_models.pop(key, None)
        pool = self.pools.pop(key, None)
        if pool is not None:
            self.gateway.close_pool(pool, ModelNotFound())
            log.info("no longer serving %s/%s", *key)
            self._changed()

    def reset(self, items: list[dict]) -> None:
        keys = set()
        for obj in items:
            meta = obj.get("metadata") or {}
            keys.add((meta.get("namespace") or "", meta.get("name")))
            self.apply(obj)
        for key in [k for k in self.views if k not in keys]:
            self.remove(key)

    def isvc_event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            meta = obj["metadata"]
            self.remove((meta.get("namespace") or "", meta["name"]))
        else:
            self.apply(obj)

    # ---- EndpointSlices --------------------------------------------------------------------------------------
    def _publish(self, view: ServiceView) -> None:
        pool = self.pools.get(view.key)
        if pool is None:
            return
        slices = self.slices.get((view.namespace, view.engine_service), {})
        # precise-prefix: the engines whose slices name KV-event ports publish there (render/network.py)
        self.gateway.set_kv_ports(pool, kv_event_ports(slices, port_name="http"))
        urls = ready_urls(slices, port_name="http")
        standby = ready_urls(slices, port_name="http", standby=True)
        if urls != {b.url for b in pool.backends.all()} or standby != pool.backends.standby:
            if urls != {b.url for b in pool.backends.all()}:
                log.info("engines of %s/%s: %s", *view.key, ", ".join(sorted(urls)) or "none")
            pool.backends.replace(urls, standby)
        # a canary revision (spec.canary): split as the service's own gateway does (gateway/canary.py)
        pool.backends.set_revisions(revisions(slices, port_name="http"), canary_percent(slices))
        # spec.prefill: each completion's prefill to its Ready prefill engines first (disaggregation.py)
        prefill = ready_urls(self.slices.get((view.namespace, view.prefill_service), {}), port_name="http") \
            if view.prefill_service else None
        self.gateway.set_prefill_engines(pool, prefill)

    def _service_changed(self, namespace: str, service: str) -> None:
        for view in self.views.values():
            if view.namespace == namespace and service in (view.engine_service, view.prefill_service):
                self._publish(view)

    def slices_reset(self, items: list[dict]) -> None:
        self.slices = {}
        for s in items:
            self._store(s)
        for view in list(self.views.values()):
            self._publish(view)

    def _store(self, s: dict) -> tuple[str, str] | None:
        meta = s.get("metadata") or {}
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if not service:
            return None
        where = (meta.get("namespace") or "", service)
        self.slices.setdefault(where, {})[meta["name"]] = s
        return where

    def slice_event(self, kind: str, s: dict) -> None:
        meta = s["metadata"]
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if not service:
            return
        where = (meta.get("namespace") or "", service)
        if kind == "DELETED":
            self.slices.get(where, {}).pop(meta["name"], None)
            if not self.slices.get(where):
                self.slices.pop(where, None)
        else:
            self._store(s)
        self._service_changed(*where)

    # ---- the engines' model lists ----------------------------------------------------------------------------
    async def poll_models(self, session: aiohttp.ClientSession) -> None:
        """Each pool's /v1/models from one ready engine, every models_interval seconds (soon for a pool whose list
        is missing), all pools concurrently."""
        while True:
            now = time.monotonic()
            # a missing list is asked for again every 2 s (an engine that just became ready), others per interval
            due = [(key, pool) for key, pool in self.pools.items() if pool.backends.eligible(now)
                   and now - self._models_polled.get(key, -1e9) >= (
                       min(2.0, self.models_interval) if key not in self.engine_models else self.models_interval)]
            for key, _ in due:
                self._models_polled[key] = now
            if due:
                await asyncio.gather(*(self._models_of(session, key, pool) for key, pool in due))
            await asyncio.sleep(0.5)

    async def _models_of(self, session: aiohttp.ClientSession, key: tuple[str, str], pool: Pool) -> None:
        engines = pool.backends.eligible()
        if not engines:
            return
        secret = self.gateway.engine_key(pool)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        try:
            async with session.get(engines[0].url + "/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    log.debug("/v1/models of %s/%s: HTTP %d", *key, r.status)
                    return
                cards = (await r.json(content_type=None)).get("data")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            log.debug("/v1/models of %s/%s: %r", *key, e)
            return
        if isinstance(cards, list) and self.pools.get(key) is pool:
            cards = [c for c in cards if isinstance(c, dict)]
            if cards != self.engine_models.get(key):
                self.engine_models[key] = cards
                self._changed()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        self.tasks = [asyncio.create_task(self.poll_models(session), name="fleet-models"), *await self.watch()]

    async def watch(self) -> list[asyncio.Task]:
        """The InferenceServices and the operator's EndpointSlices, listed then watched."""
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)
        where = f"namespace {self.namespace}" if self.namespace else "every namespace"
        isvcs = Informer(self.api, collection_path(ISVC_GROUP_VERSION, ISVC_PLURAL, self.namespace),
                         on_list=self.reset, on_event=self.isvc_event, what=f"InferenceServices in {where}")
        slices = Informer(self.api, collection_path("discovery.k8s.io/v1", "endpointslices", self.namespace),
                          label_selector=MANAGED_SELECTOR, on_list=self.slices_reset, on_event=self.slice_event,
                          what=f"EndpointSlices in {where}")
        return [asyncio.create_task(isvcs.run(), name="fleet-isvcs"),
                asyncio.create_task(slices.run(), name="fleet-slices")]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for key in list(self.pools):
            self.remove(key)
