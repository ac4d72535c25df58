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
  without its own gateway) are the pool's backends.

Model names come from the specs (the served name, spec.adapters), from each pool's engines' /v1/models (adapters
loaded at run time, with `parent`), polled every `models_interval` seconds, and — for an adapter loaded since the
last poll — from the residency the engines' metrics report. One name served by two services goes to the one
serving it as its base model, else to the oldest service (a warning says so). An unknown name is a 404 that lists
nothing (what a caller may not see stays unseen). Everything waiting in a pool whose service is deleted gets 404.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from shoal.operator import contract
from shoal.operator.gateway.discovery import ready_urls
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


class ModelNotFound(LookupError):
    """No InferenceService serves this model (404)."""


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
    max_inflight: int = 0
    engine_priority: bool = False
    adapters: tuple[str, ...] = ()
    adapter_priorities: tuple[tuple[str, int], ...] = ()  # (name, priority) of adapters with their own
    created: str = ""

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
            max_inflight=_int(engine.get("maxNumSeqs"), 0),
            engine_priority=engine.get("schedulingPolicy") == "priority",
            adapters=adapters, adapter_priorities=adapter_priorities, created=meta.get("creationTimestamp") or "")


def _epoch(stamp: str) -> int:
    try:
        return int(datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


class Fleet:
    """Pools by InferenceService, and the model-name index over them."""

    shared = True

    def __init__(self, gateway: "Gateway", namespace: str | None, api: KubeAPI | None = None,
                 models_interval: float = 10.0):
        self.gateway = gateway
        self.namespace = namespace  # None: every namespace
        self.api = api
        self.models_interval = models_interval
        self.views: dict[tuple[str, str], ServiceView] = {}
        self.pools: dict[tuple[str, str], Pool] = {}
        self.slices: dict[tuple[str, str], dict[str, dict]] = {}  # (namespace, service) -> slice name -> slice
        self.engine_models: dict[tuple[str, str], list[dict]] = {}  # the engines' /v1/models, per service
        self._models_polled: dict[tuple[str, str], float] = {}
        self._index: dict[str, Pool] | None = None
        self._conflicts: set[str] = set()
        self.tasks: list[asyncio.Task] = []

    # ---- the index -------------------------------------------------------------------------------------------
    def _names(self, key: tuple[str, str]) -> list[tuple[str, bool]]:
        """(model name, is the base model) for everything the service serves that the gateway knows of."""
        view = self.views[key]
        names = [(view.served_name, True)] + [(a, False) for a in view.adapters]
        for card in self.engine_models.get(key, ()):
            if isinstance(card.get("id"), str) and card.get("parent"):
                names.append((card["id"], False))
        return names

    def index(self) -> dict[str, Pool]:
        if self._index is None:
            best: dict[str, tuple[tuple, Pool]] = {}
            for key, pool in self.pools.items():
                created = self.views[key].created or "~"
                for model, base in self._names(key):
                    rank = (not base, created, key)  # the base model first, then the oldest service
                    held = best.get(model)
                    if held is not None and held[1] is not pool and model not in self._conflicts:
                        self._conflicts.add(model)
                        winner = pool if rank < held[0] else held[1]
                        log.warning("model %r is served by %s and %s: routed to %s", model, held[1].key, pool.key,
                                    winner.key)
                    if held is None or rank < held[0]:
                        best[model] = (rank, pool)
            self._index = {model: pool for model, (_, pool) in best.items()}
        return self._index

    def _changed(self) -> None:
        self._index = None

    def resolve(self, model: str | None) -> Pool | None:
        if not model:
            return None
        pool = self.index().get(model)
        if pool is None:  # an adapter loaded since the last /v1/models poll: the engines' metrics know it
            for p in self.pools.values():
                if any(model in b.lora_resident for b in p.backends.all()):
                    return p
        return pool

    def all(self) -> list[Pool]:
        return list(self.pools.values())

    def models(self) -> list[dict]:
        """The aggregated /v1/models: every service's base model and adapters, as its engines describe them when
        they answered, else from the spec."""
        cards: dict[str, dict] = {}
        for model, pool in sorted(self.index().items()):
            key = (pool.namespace, pool.name)
            view = self.views[key]
            known = {c.get("id"): c for c in self.engine_models.get(key, ())}
            if model in known:
                cards[model] = dict(known[model])
            else:
                base = model == view.served_name
                cards[model] = {"id": model, "object": "model", "created": _epoch(view.created), "owned_by": "shoal",
                                "root": model if base else None, "parent": None if base else view.served_name,
                                "permission": []}
        for pool in self.pools.values():  # adapters the engines report resident, not yet in a /v1/models poll
            for b in pool.backends.all():
                for adapter in b.lora_resident:
                    cards.setdefault(adapter, {"id": adapter, "object": "model", "created": 0, "owned_by": "shoal",
                                               "root": None, "parent": pool.served_name, "permission": []})
        return list(cards.values())

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
        if old is None or old.engine_service != view.engine_service:
            self._publish(view)
        self._changed()

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
        urls = ready_urls(self.slices.get((view.namespace, view.engine_service), {}), port_name="http")
        if urls != {b.url for b in pool.backends.all()}:
            log.info("engines of %s/%s: %s", *view.key, ", ".join(sorted(urls)) or "none")
            pool.backends.replace(urls)

    def _service_changed(self, namespace: str, service: str) -> None:
        for view in self.views.values():
            if view.namespace == namespace and view.engine_service == service:
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
