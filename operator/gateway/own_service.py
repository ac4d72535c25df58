"""The per-service gateway's own InferenceService (`--inference-service NAME`): what its spec declares.

The shared gateway reads every InferenceService (fleet.py); a per-service gateway reads the one it fronts, listed and
watched by name (field selector `metadata.name`, so its Role grants get/list/watch on that one object only), and
sets its pool from the spec as the shared gateway sets each of its pools:

* the adapters `spec.adapters` declares: a request for one that no engine lists yet (just added and still loading,
  or the engines restarted and reload it) is held apart from the admission queue until an engine lists it, up to
  --queue-timeout, then answered 503 adapter_not_loaded (pool.py) — instead of reaching an engine that 404s;
* the served name: the base model is never taken for an adapter.

The spec is the one source of truth and is watched, so an adapter added to it is known within a watch event: no
gateway restart, no Deployment roll. Until the first list lands (or while the API server cannot be read) the pool
knows only the adapters its engines list, as before.
"""

from __future__ import annotations

import asyncio
import logging

from shoal.operator.gateway.fleet import ISVC_GROUP_VERSION, ISVC_PLURAL, ServiceView
from shoal.operator.gateway.pool import Pool
from shoal.operator.k8s.client import KubeAPI, collection_path
from shoal.operator.k8s.informer import Informer

log = logging.getLogger("shoal.gateway.own_service")


class OwnService:
    def __init__(self, name: str, namespace: str, api: KubeAPI | None = None):
        self.name = name
        self.namespace = namespace
        self.api = api
        self.read = False  # the spec was read at least once

    def apply(self, pool: Pool, obj: dict | None) -> None:
        """The service as listed or changed (None: it is gone, or not there)."""
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            adapters, served = frozenset(), pool.served_name
        else:
            try:
                view = ServiceView.of(obj)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("cannot read InferenceService %s/%s: %r", self.namespace, self.name, e)
                return
            adapters, served = frozenset(view.adapters), view.served_name
        if (adapters, served) != (pool.adapters, pool.served_name):
            log.info("InferenceService %s/%s serves %s with adapters %s", self.namespace, self.name, served,
                     ", ".join(sorted(adapters)) or "none declared")
        pool.adapters, pool.served_name = adapters, served
        self.read = True

    async def run(self, pool: Pool) -> None:
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)

        def listed(items: list[dict]) -> None:
            self.apply(pool, next((o for o in items if (o.get("metadata") or {}).get("name") == self.name), None))

        def event(kind: str, obj: dict) -> None:
            if (obj.get("metadata") or {}).get("name") == self.name:
                self.apply(pool, None if kind == "DELETED" else obj)

        await Informer(self.api, collection_path(ISVC_GROUP_VERSION, ISVC_PLURAL, self.namespace),
                       field_selector=f"metadata.name={self.name}", on_list=listed, on_event=event,
                       what=f"InferenceService {self.namespace}/{self.name}").run()
