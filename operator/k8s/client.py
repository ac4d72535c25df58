"""One async Kubernetes client over aiohttp.

`KubeAPI` says where the API server is and how to authenticate: in a pod, the service-account token (re-read on
every request, since bound tokens rotate) and CA; elsewhere, the kubeconfig that $KUBECONFIG names *now*, read with
the kubernetes package's loader only (its token or client certificate, its CA). `Client` makes the calls, on one
aiohttp session (its own, opened on first use in the running loop, or one the caller shares).

Writes: server-side apply (``application/apply-patch+yaml`` with a field manager, ``force=true``) and JSON merge
patches; no PUT, no strategic merge. A non-2xx answer raises `ApiError` with the API's reason and message.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str = ""):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def collection_path(api_version: str, plural: str, namespace: str | None = None) -> str:
    """/api/v1/configmaps, /apis/discovery.k8s.io/v1/namespaces/ns/endpointslices, ... (None: every namespace)."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"


def object_path(api_version: str, plural: str, namespace: str, name: str, subresource: str | None = None) -> str:
    p = f"{collection_path(api_version, plural, namespace)}/{quote(name)}"
    return f"{p}/{subresource}" if subresource else p


def load_configuration() -> Any:
    """A fresh `kubernetes.client.Configuration`: the in-cluster service account when running in a pod, else
    the kubeconfig named by $KUBECONFIG *now* (the client library fixes its default path at import time)."""
    import kubernetes

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        config_file = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        kubernetes.config.load_kube_config(config_file=config_file, client_configuration=configuration)
    return configuration


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
        """In a pod its service account (the token re-read per request), else the kubeconfig $KUBECONFIG names now
        (blocking: a few hundred milliseconds; call it in a thread from a running loop)."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if host and os.path.exists(os.path.join(SA_DIR, "token")):
            if ":" in host:
                host = f"[{host}]"
            ctx = ssl.create_default_context(cafile=os.path.join(SA_DIR, "ca.crt"))
            return cls(f"https://{host}:{port}", token_file=os.path.join(SA_DIR, "token"), ssl_context=ctx)
        return cls.from_configuration(load_configuration())

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

    def url(self, path: str, query: dict[str, Any] | None = None) -> str:
        query = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        return self.server + path + (f"?{urlencode(query)}" if query else "")


class Client:
    """The verbs, on paths (see collection_path / object_path). `api` None: KubeAPI.from_environment() on first
    use; `session` None: an own session, opened on first use and closed by `close()`."""

    def __init__(self, api: KubeAPI | None = None, session: aiohttp.ClientSession | None = None,
                 timeout: float = 60.0):
        self.api = api
        self.session = session
        self._own_session = session is None
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10)

    async def connect(self) -> aiohttp.ClientSession:
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self.session

    async def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        session = await self.connect()
        headers = {**self.api.headers(), "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)  # JSON is YAML too: apply-patch+yaml accepts it
        async with session.request(method, self.api.url(path, query), data=data, headers=headers,
                                   ssl=self.api.ssl_context, timeout=self.timeout) as r:
            raw = await r.read()
            if not 200 <= r.status < 300:
                try:
                    status = json.loads(raw or b"{}")
                except ValueError:
                    status = {}
                status = status if isinstance(status, dict) else {}
                raise ApiError(r.status, status.get("reason") or r.reason or "",
                               status.get("message") or raw.decode(errors="replace")[:300])
        return json.loads(raw) if raw else {}

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def list(self, path: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        data = await self.request("GET", path, query={"labelSelector": label_selector,
                                                      "fieldSelector": field_selector})
        return data.get("items") or []

    async def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST to a collection: 409 when the name is taken (use generateName for Events)."""
        return await self.request("POST", path, body=obj)

    async def apply(self, path: str, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of a complete desired object (creates it when missing): afterwards the object holds
        exactly these fields of this manager; fields it applied before and no longer does are removed."""
        return await self.request("PATCH", path, body=obj, query={"fieldManager": field_manager, "force": "true"},
                                  content_type="application/apply-patch+yaml")

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, path: str, *, uid: str | None = None, propagation: str = "Background") -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if uid:  # never delete a same-named successor of the object we decided about
            body["preconditions"] = {"uid": uid}
        await self.request("DELETE", path, body=body)

    async def close(self) -> None:
        if self.session is not None and self._own_session:
            await self.session.close()
        self.session = None if self._own_session else self.session
