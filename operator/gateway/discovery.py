"""Where the engines are: fixed `--endpoint` URLs, or a Kubernetes Service's EndpointSlices (`ListWatch` is the
list-then-watch loop, also used by the shared gateway's view of InferenceServices, fleet.py).

EndpointSlices are listed, then watched from the list's resourceVersion (re-listed after a 410 Gone or any
error, with backoff). Only endpoints whose `conditions.ready` is true (or unset, which Kubernetes defines as
ready) are backends, so a pod that starts terminating — its endpoint turns not-ready — gets nothing new the moment
the watch event arrives. While the API server is unreachable the last known set stays in force.

Plain aiohttp against the API server: in a pod it uses the service-account token (re-read on every connect,
since bound tokens rotate) and CA; elsewhere the current kubeconfig context (read with the kubernetes client's
loader only, so no extra dependency).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

import aiohttp

from shoal.operator.gateway.backends import BackendSet

log = logging.getLogger("shoal.gateway.discovery")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class StaticDiscovery:
    def __init__(self, urls: list[str]):
        self.urls = urls

    async def run(self, backends: BackendSet) -> None:
        backends.replace(self.urls)


@dataclass
class KubeAPI:
    """How to reach the API server."""

    server: str
    token: str | None = None
    token_file: str | None = None
    ssl_context: ssl.SSLContext | bool | None = None

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file:
            with open(self.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    @classmethod
    def from_environment(cls) -> "KubeAPI":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if host and os.path.exists(os.path.join(SA_DIR, "token")):
            if ":" in host:
                host = f"[{host}]"
            ctx = ssl.create_default_context(cafile=os.path.join(SA_DIR, "ca.crt"))
            return cls(f"https://{host}:{port}", token_file=os.path.join(SA_DIR, "token"), ssl_context=ctx)
        from kubernetes import client, config  # the loader only; requests go through aiohttp

        c = client.Configuration()
        config.load_kube_config(client_configuration=c)
        return cls.from_configuration(c)

    @classmethod
    def from_configuration(cls, c) -> "KubeAPI":
        """From a loaded `kubernetes.client.Configuration`: its server, bearer token or client certificate, CA."""
        header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization") or ""
        token = header.split(" ", 1)[1] if header.lower().startswith("bearer ") else header or None
        ctx: ssl.SSLContext | bool | None = None
        if c.host.startswith("https"):
            if not c.verify_ssl:
                ctx = False
            else:
                ctx = ssl.create_default_context(cafile=c.ssl_ca_cert)
                if c.cert_file:
                    ctx.load_cert_chain(c.cert_file, c.key_file)
        return cls(c.host.rstrip("/"), token=token, ssl_context=ctx)


def ready_urls(slices: dict[str, dict], scheme: str = "http", port_name: str | None = None) -> set[str]:
    """Base URLs of the Ready endpoints of these EndpointSlices."""
    urls = set()
    for s in slices.values():
        ports = [p for p in s.get("ports") or [] if p.get("protocol", "TCP") == "TCP" and p.get("port")]
        if port_name is not None:
            ports = [p for p in ports if p.get("name") == port_name]
        if not ports:
            continue
        port = ports[0]["port"]
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in (ep.get("addresses") or [])[:1]:
                host = f"[{addr}]" if ":" in addr else addr
                urls.add(f"{scheme}://{host}:{port}")
    return urls


class ListWatch:
    """List a collection, then watch it from the list's resourceVersion; re-list after a 410 Gone or any error,
    with backoff, keeping the last known state meanwhile. `reset(items)` gets every list, `event(type, obj)`
    every ADDED / MODIFIED / DELETED (bookmarks only move the resourceVersion)."""

    def __init__(self, api: KubeAPI, path: str, what: str, label_selector: str | None = None,
                 watch_timeout: int = 300):
        self.api = api
        self.path = path  # e.g. /apis/discovery.k8s.io/v1/namespaces/ns/endpointslices
        self.what = what  # for logs
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout

    def _url(self, **query: str) -> str:
        params = {"labelSelector": self.label_selector} if self.label_selector else {}
        params.update(query)
        return self.api.server + self.path + ("?" + "&".join(f"{k}={quote(v)}" for k, v in params.items())
                                              if params else "")

    async def run(self, reset: Callable[[list[dict]], None], event: Callable[[str, dict], None]) -> None:
        backoff = 0.5
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
            while True:
                try:
                    rv = await self._list(session, reset)
                    backoff = 0.5
                    await self._watch(session, event, rv)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - keep the last known state and try again
                    log.warning("%s: %r; retrying in %.1fs", self.what, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)

    async def _list(self, session: aiohttp.ClientSession, reset: Callable[[list[dict]], None]) -> str:
        async with session.get(self._url(), headers=self.api.headers(), ssl=self.api.ssl_context,
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                raise RuntimeError(f"list: HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json(content_type=None)
        reset(data.get("items") or [])
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    async def _watch(self, session: aiohttp.ClientSession, event: Callable[[str, dict], None], rv: str) -> None:
        query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_timeout)}
        if rv:
            query["resourceVersion"] = rv
        timeout = aiohttp.ClientTimeout(total=self.watch_timeout + 30, sock_read=self.watch_timeout + 30)
        async with session.get(self._url(**query), headers=self.api.headers(), ssl=self.api.ssl_context,
                               timeout=timeout) as r:
            if r.status != 200:
                raise RuntimeError(f"watch: HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.strip():
                    continue
                item = json.loads(line)
                kind, obj = item.get("type"), item.get("object") or {}
                if kind == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")  # 410 Gone included: relist
                if kind == "BOOKMARK" or not (obj.get("metadata") or {}).get("name"):
                    continue
                event(kind, obj)


def collection_path(group_version: str, plural: str, namespace: str | None) -> str:
    """The API path of a collection, in one namespace or (None) in all of them."""
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"


class EndpointSliceDiscovery:
    def __init__(self, service: str, namespace: str, api: KubeAPI | None = None, port_name: str | None = None,
                 watch_timeout: int = 300):
        self.service = service
        self.namespace = namespace
        self.api = api
        self.port_name = port_name
        self.watch_timeout = watch_timeout
        self.slices: dict[str, dict] = {}

    def _publish(self, backends: BackendSet) -> None:
        urls = ready_urls(self.slices, port_name=self.port_name)
        before = {b.url for b in backends.all()}
        if urls != before:
            log.info("backends of %s/%s: %s", self.namespace, self.service, ", ".join(sorted(urls)) or "none")
            backends.replace(urls)

    async def run(self, backends: BackendSet) -> None:
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)

        def reset(items: list[dict]) -> None:
            self.slices = {s["metadata"]["name"]: s for s in items}
            self._publish(backends)

        def event(kind: str, obj: dict) -> None:
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self.slices.pop(name, None)
            else:
                self.slices[name] = obj
            self._publish(backends)

        await ListWatch(self.api, collection_path("discovery.k8s.io/v1", "endpointslices", self.namespace),
                        f"EndpointSlice discovery for {self.namespace}/{self.service}",
                        f"kubernetes.io/service-name={self.service}", self.watch_timeout).run(reset, event)
