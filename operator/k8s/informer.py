"""One list-then-watch cache ("informer") of a collection, with optional indexes.

An `Informer` lists one collection (a resource type, in one namespace or cluster-wide, optionally by label
selector), then watches it from the list's resourceVersion, applying every event to an in-memory copy:
* watch lines are split by the informer itself (an object may be larger than any line limit), and a watch that
  ends (its server timeout) resumes from the last resourceVersion seen, bookmarks included;
* a 410 Gone (or an ERROR event) or any failure relists, with exponential backoff; while the API server is
  unreachable the last known objects stay in force;
* `index` groups objects by a key (EndpointSlices by their Service); `on_event(type, obj)` sees every change as it
  lands; `on_list(items)`, when given, gets each complete list instead of per-object ADDED/DELETED events (a
  consumer that rebuilds its state from the whole set).

The autoscaler's caches and the gateway's views (EndpointSlices, InferenceServices) are informers. They do not
depend on kopf: kopf closes its own watch streams while an operator replica stands by for a peer, whereas a standby
autoscaler keeps warm caches and takes over with current data.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Hashable
from typing import Any

import aiohttp

from shoal.operator.k8s.client import KubeAPI, collection_path

logger = logging.getLogger("shoal.operator.informer")

Key = tuple[str | None, str]  # (namespace, name)
MAX_BACKOFF = 10.0


class Gone(Exception):
    """The watch's resourceVersion expired (410, or an ERROR event): relist."""


def object_key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace"), meta.get("name", "")


class Informer:
    def __init__(self, api: KubeAPI | None, path: str, *, label_selector: str | None = None,
                 field_selector: str | None = None,
                 index: Callable[[dict[str, Any]], Hashable | None] | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 on_list: Callable[[list[dict[str, Any]]], None] | None = None,
                 watch_timeout: int = 300, what: str | None = None):
        self.api = api  # None: KubeAPI.from_environment() when run starts
        self.path = path
        self.label_selector = label_selector
        self.field_selector = field_selector  # e.g. metadata.name=X: one object (RBAC resourceNames can allow it)
        self.index = index
        self.on_event = on_event
        self.on_list = on_list
        self.watch_timeout = watch_timeout
        self.what = what or path  # for logs
        self.objects: dict[Key, dict[str, Any]] = {}
        self.indexed: dict[Hashable, dict[Key, dict[str, Any]]] = {}
        self.synced = asyncio.Event()  # set once the first list has landed
        self.lists = 0  # how many times the collection was listed (once, plus one per relist)
        self.watches = 0  # watch requests made (a resumed watch is one more)

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

    def _call(self, callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is not None:
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the cache
                logger.exception("informer %s: event handler failed", self.what)

    # ---- list and watch ----------------------------------------------------------------------------------------
    async def run(self, session: aiohttp.ClientSession | None = None) -> None:
        """List and watch until cancelled (on the caller's session, or an own one)."""
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)
        if session is None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as own:
                return await self.run(own)
        backoff = 0.5
        while True:
            try:
                rv = await self._list(session)
                backoff = 0.5
                while True:  # a watch that times out resumes where it was; Gone or an error relists
                    rv = await self._watch(session, rv)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the last known objects and try again
                level = logging.INFO if isinstance(e, Gone) else logging.WARNING
                logger.log(level, "informer %s: %r; relisting in %.1fs", self.what, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        url = self.api.url(self.path, {"labelSelector": self.label_selector, "fieldSelector": self.field_selector})
        async with session.get(url, headers=self.api.headers(), ssl=self.api.ssl_context,
                               timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status != 200:
                raise RuntimeError(f"list: HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json(content_type=None)
        self.lists += 1
        items = data.get("items") or []
        listed = {object_key(o) for o in items}
        gone = [self.objects[k] for k in self.objects if k not in listed]
        for obj in gone:
            self._drop(object_key(obj))
        for obj in items:
            self._put(obj)
        if self.on_list is not None:
            self._call(self.on_list, items)
        else:
            for obj in gone:
                self._call(self.on_event, "DELETED", obj)
            for obj in items:
                self._call(self.on_event, "ADDED", obj)
        self.synced.set()
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    async def _watch(self, session: aiohttp.ClientSession, rv: str) -> str:
        """Apply the events of one watch request; -> the resourceVersion to resume from. Raises Gone to relist."""
        self.watches += 1
        url = self.api.url(self.path, {"labelSelector": self.label_selector, "fieldSelector": self.field_selector,
                                       "watch": "true",
                                       "allowWatchBookmarks": "true", "timeoutSeconds": self.watch_timeout,
                                       "resourceVersion": rv})
        timeout = aiohttp.ClientTimeout(total=self.watch_timeout + 30, sock_read=self.watch_timeout + 30)
        async with session.get(url, headers=self.api.headers(), ssl=self.api.ssl_context, timeout=timeout) as r:
            if r.status == 410:
                raise Gone(f"watch from resourceVersion {rv}: HTTP 410")
            if r.status != 200:
                raise RuntimeError(f"watch: HTTP {r.status}: {(await r.text())[:300]}")
            buffer = b""
            async for chunk in r.content.iter_any():  # lines can be long (objects of any size): split ourselves
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        rv = self._apply(json.loads(line), rv)
        return rv

    def _apply(self, event: dict[str, Any], rv: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # 410 Gone (expired resourceVersion) included: relist
            raise Gone(f"watch error: {obj.get('message') or obj}")
        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
        if kind == "BOOKMARK" or not (obj.get("metadata") or {}).get("name"):
            return rv
        if kind == "DELETED":
            self._drop(object_key(obj))
        else:
            self._put(obj)
        self._call(self.on_event, kind or "MODIFIED", obj)
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
