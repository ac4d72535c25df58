"""Watch-fed caches ("informers") of the objects the autoscaler reads: it never lists per decision.

An `Informer` lists one collection once (a resource type, in one namespace or cluster-wide, optionally by label
selector), then watches it from the list's resourceVersion, applying every event to an in-memory copy. A watch that
ends (its server timeout) resumes from the last resourceVersion seen (bookmarks included); a 410 Gone or any error
relists, with backoff, and while the API server is unreachable the last known objects stay in force. An optional
`index` groups objects by a key (EndpointSlices by their Service), and `on_event` sees every change as it lands.

These caches do not depend on kopf: kopf closes its own watch streams while an operator replica stands by for a
peer (its indexes go stale there), whereas a standby autoscaler keeps warm caches and takes over with current data.
Requests go through aiohttp with the gateway's `KubeAPI` (in a pod: the service-account token, re-read on every
request since bound tokens rotate; elsewhere: the kubeconfig's server, token and TLS).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Hashable
from typing import Any
from urllib.parse import urlencode

import aiohttp

from shoal.operator.gateway.discovery import KubeAPI

logger = logging.getLogger("shoal.operator.informer")

Key = tuple[str | None, str]  # (namespace, name)


def kube_api() -> KubeAPI:
    """How the informers reach the API server: in a pod its service account (KubeAPI re-reads the token), else
    the kubeconfig that $KUBECONFIG names now (kube.load_configuration), with its token or client certificate."""
    import os

    from shoal.operator.gateway.discovery import SA_DIR
    from shoal.operator.kube import load_configuration

    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(os.path.join(SA_DIR, "token")):
        return KubeAPI.from_environment()
    return KubeAPI.from_configuration(load_configuration())


def collection_path(api_version: str, plural: str, namespace: str | None = None) -> str:
    """/api/v1/configmaps, /apis/discovery.k8s.io/v1/namespaces/ns/endpointslices, ..."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def object_key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace"), meta.get("name", "")


class Informer:
    def __init__(self, api: KubeAPI, path: str, *, label_selector: str | None = None,
                 index: Callable[[dict[str, Any]], Hashable | None] | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None, watch_timeout: int = 300):
        self.api = api
        self.path = path
        self.label_selector = label_selector
        self.index = index
        self.on_event = on_event
        self.watch_timeout = watch_timeout
        self.objects: dict[Key, dict[str, Any]] = {}
        self.indexed: dict[Hashable, dict[Key, dict[str, Any]]] = {}
        self.synced = asyncio.Event()  # set once the first list has landed
        self.lists = 0  # how many times the collection was listed (once, plus one per relist)

    # ---- reading (the caller's copies are the cache's objects: never modify them) ----------------------------
    def get(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.objects.get((namespace, name))

    def values(self) -> list[dict[str, Any]]:
        return list(self.objects.values())

    def by_index(self, key: Hashable) -> list[dict[str, Any]]:
        return list(self.indexed.get(key, {}).values())

    # ---- the cache ---------------------------------------------------------------------------------------------
    def _put(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        self._drop(key)
        self.objects[key] = obj
        if self.index is not None and (group := self.index(obj)) is not None:
            self.indexed.setdefault(group, {})[key] = obj

    def _drop(self, key: Key) -> None:
        old = self.objects.pop(key, None)
        if old is not None and self.index is not None and (group := self.index(old)) is not None:
            members = self.indexed.get(group, {})
            members.pop(key, None)
            if not members:
                self.indexed.pop(group, None)

    def _notify(self, kind: str, obj: dict[str, Any]) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, obj)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the cache
                logger.exception("informer %s: event handler failed", self.path)

    # ---- list and watch ----------------------------------------------------------------------------------------
    def _url(self, **params: Any) -> str:
        query = {k: v for k, v in (("labelSelector", self.label_selector), *params.items()) if v not in (None, "")}
        return f"{self.api.server}{self.path}" + (f"?{urlencode(query)}" if query else "")

    async def run(self, session: aiohttp.ClientSession) -> None:
        backoff = 0.5
        while True:
            try:
                rv = await self._list(session)
                backoff = 0.5
                while rv:  # a watch that times out resumes where it was; an error relists
                    rv = await self._watch(session, rv)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the last known objects and try again
                logger.warning("informer %s: %r; relisting in %.1fs", self.path, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self._url(), headers=self.api.headers(), ssl=self.api.ssl_context,
                               timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status != 200:
                raise RuntimeError(f"list: HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json(content_type=None)
        self.lists += 1
        items = data.get("items") or []
        listed = {object_key(o) for o in items}
        for key in [k for k in self.objects if k not in listed]:
            gone = self.objects[key]
            self._drop(key)
            self._notify("DELETED", gone)
        for obj in items:
            self._put(obj)
            self._notify("ADDED", obj)
        self.synced.set()
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    async def _watch(self, session: aiohttp.ClientSession, rv: str) -> str | None:
        """Apply the events of one watch request; -> the resourceVersion to resume from, None to relist."""
        url = self._url(watch="true", allowWatchBookmarks="true", timeoutSeconds=self.watch_timeout,
                        resourceVersion=rv)
        timeout = aiohttp.ClientTimeout(total=self.watch_timeout + 30, sock_read=self.watch_timeout + 30)
        async with session.get(url, headers=self.api.headers(), ssl=self.api.ssl_context, timeout=timeout) as r:
            if r.status == 410:
                return None
            if r.status != 200:
                raise RuntimeError(f"watch: HTTP {r.status}: {(await r.text())[:300]}")
            buffer = b""
            async for chunk in r.content.iter_any():  # lines can be long (objects of any size): split ourselves
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        rv = self._apply(json.loads(line), rv)
                        if rv is None:
                            return None
        return rv

    def _apply(self, event: dict[str, Any], rv: str) -> str | None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # 410 Gone (expired resourceVersion) included: relist
            logger.info("informer %s: watch error %s; relisting", self.path, obj.get("message") or obj)
            return None
        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
        if kind == "BOOKMARK":
            return rv
        if kind == "DELETED":
            self._drop(object_key(obj))
        else:
            self._put(obj)
        self._notify(kind or "MODIFIED", obj)
        return rv


class Informers:
    """One `Informer` per watched namespace, or one cluster-wide (namespaces empty), read as one cache."""

    def __init__(self, api: KubeAPI, api_version: str, plural: str, namespaces: tuple[str, ...] = (), **kwargs: Any):
        self.by_namespace = {ns: Informer(api, collection_path(api_version, plural, ns), **kwargs)
                             for ns in (namespaces or (None,))}

    @property
    def all(self) -> list[Informer]:
        return list(self.by_namespace.values())

    def _for(self, namespace: str | None) -> Informer | None:
        return self.by_namespace.get(namespace) or self.by_namespace.get(None)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        informer = self._for(namespace)
        return informer.get(namespace, name) if informer else None

    def values(self) -> list[dict[str, Any]]:
        return [obj for informer in self.all for obj in informer.values()]

    def by_index(self, key: Hashable, namespace: str | None = None) -> list[dict[str, Any]]:
        informer = self._for(namespace)
        return informer.by_index(key) if informer else []

    @property
    def lists(self) -> int:
        return sum(i.lists for i in self.all)

    async def wait_synced(self) -> None:
        await asyncio.gather(*(i.synced.wait() for i in self.all))
