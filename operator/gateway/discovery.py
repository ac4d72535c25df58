"""Where the engines are: fixed `--endpoint` URLs, or a Kubernetes Service's EndpointSlices, through the fleet
half's informer (shoal.operator.k8s.informer, also behind the shared gateway's view of InferenceServices, fleet.py).

EndpointSlices are listed, then watched from the list's resourceVersion (re-listed after a 410 Gone or any
error, with backoff). Only endpoints whose `conditions.ready` is true (or unset, which Kubernetes defines as
ready) are backends, so a pod that starts terminating — its endpoint turns not-ready — gets nothing new the moment
the watch event arrives. While the API server is unreachable the last known set stays in force.

The API server is reached as k8s.client.KubeAPI says: in a pod the service-account token (re-read on every
request, since bound tokens rotate) and CA; elsewhere the current kubeconfig context.
"""

from __future__ import annotations

import asyncio
import logging

from shoal.operator import contract
from shoal.operator.gateway.backends import BackendSet
from shoal.operator.k8s.client import KubeAPI, collection_path
from shoal.operator.k8s.informer import Informer

log = logging.getLogger("shoal.gateway.discovery")

class StaticDiscovery:
    def __init__(self, urls: list[str]):
        self.urls = urls

    async def run(self, backends: BackendSet) -> None:
        backends.replace(self.urls)


def ready_urls(slices: dict[str, dict], scheme: str = "http", port_name: str | None = None,
               standby: bool = False) -> set[str]:
    """Base URLs of the Ready endpoints of these EndpointSlices; with `standby`, of the not-Ready ones that are not
    terminating instead (engines loading, or parked asleep, which the gateway may wake)."""
    urls = set()
    for s in slices.values():
        ports = [p for p in s.get("ports") or [] if p.get("protocol", "TCP") == "TCP" and p.get("port")]
        if port_name is not None:
            ports = [p for p in ports if p.get("name") == port_name]
        if not ports:
            continue
        port = ports[0]["port"]
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if standby != (conditions.get("ready") is False) or (standby and conditions.get("terminating")):
                continue
            for addr in (ep.get("addresses") or [])[:1]:
                host = f"[{addr}]" if ":" in addr else addr
                urls.add(f"{scheme}://{host}:{port}")
    return urls


def kv_event_ports(slices: dict[str, dict], scheme: str = "http", port_name: str = "http"
                   ) -> dict[str, tuple[int, int | None]]:
    """Base URL -> (KV-events port, replay port or None) of the Ready endpoints of the slices that name a
    contract.KV_EVENTS_PORT_NAME port: the engines that publish their KV events, and where."""
    found: dict[str, tuple[int, int | None]] = {}
    for name, s in slices.items():
        named = {p.get("name"): p.get("port") for p in s.get("ports") or [] if p.get("protocol", "TCP") == "TCP"}
        events, replay = named.get(contract.KV_EVENTS_PORT_NAME), named.get(contract.KV_REPLAY_PORT_NAME)
        if not isinstance(events, int) or not 0 < events < 65536:
            continue
        replay = replay if isinstance(replay, int) and 0 < replay < 65536 else None
        for url in ready_urls({name: s}, scheme, port_name):
            found[url] = (events, replay)
    return found


def revisions(slices: dict[str, dict], scheme: str = "http", port_name: str | None = None) -> dict[str, str]:
    """Base URL -> revision (contract.endpoint_revision) of the canary's endpoints among these slices."""
    found = {}
    for s in slices.values():
        isvc = ((s.get("metadata") or {}).get("labels") or {}).get(contract.L_ISVC)
        for ep in s.get("endpoints") or []:
            if contract.endpoint_revision(isvc, (ep.get("targetRef") or {}).get("name")) != contract.CANARY:
                continue
            for url in ready_urls({"one": {**s, "endpoints": [ep]}}, scheme, port_name):
                found[url] = contract.CANARY
    return found


def canary_percent(slices: dict[str, dict]) -> float:
    """The canary's share the operator put on the engines Service (copied to every slice of it); 0 without one."""
    for s in slices.values():
        value = ((s.get("metadata") or {}).get("labels") or {}).get(contract.L_CANARY_PERCENT)
        if value is not None:
            try:
                return min(max(float(value), 0.0), 100.0)
            except ValueError:
                log.warning("ignoring %s=%r on EndpointSlice %s", contract.L_CANARY_PERCENT, value,
                            s["metadata"].get("name"))
    return 0.0


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
        standby = ready_urls(self.slices, port_name=self.port_name, standby=True)
        before = {b.url for b in backends.all()}
        if urls != before or standby != backends.standby:
            if urls != before:
                log.info("backends of %s/%s: %s", self.namespace, self.service, ", ".join(sorted(urls)) or "none")
            backends.replace(urls, standby)
        revs, percent = revisions(self.slices, port_name=self.port_name), canary_percent(self.slices)
        if percent != backends.canary_percent or any(b.revision != revs.get(b.url, contract.STABLE)
                                                     for b in backends.all()):
            log.info("canary of %s/%s: %g%% to %s", self.namespace, self.service, percent,
                     ", ".join(sorted(revs)) or "no engine")
            backends.set_revisions(revs, percent)
            backends.notify()

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

        await Informer(self.api, collection_path("discovery.k8s.io/v1", "endpointslices", self.namespace),
                       label_selector=f"kubernetes.io/service-name={self.service}", on_list=reset, on_event=event,
                       watch_timeout=self.watch_timeout,
                       what=f"EndpointSlice discovery for {self.namespace}/{self.service}").run()
