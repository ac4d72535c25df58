"""How the engines are reached: the Service `<name>` (the gateway's pods or the rank-0 engines), the
headless Services of multi-pod groups and of the engines the gateway discovers, the engines' NetworkPolicy and
their PodDisruptionBudget. Separate because exposure is the same whatever the engine pod runs, and the gateway's
children build on it.
"""

from __future__ import annotations

import copy
from typing import Any

from shoal.operator import adapters
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec, MASTER_PORT
from shoal.operator.contract import L_CANARY_PERCENT, L_GROUP, L_POD_INDEX, engines_service_name, prefill_name
from shoal.operator.render.common import (Settings, _finish, _meta, gateway_selector, group_name, pod_selector,
                                          prefill_selector)
from shoal.operator.render.containers import (KV_EVENTS_PORT, KV_REPLAY_PORT, kv_events_service_ports, precise_prefix,
                                              shared_gateway_precise)
from shoal.operator.render.shared_gateway import shared_gateway_peers


def headless_service(isvc: dict[str, Any], spec: InferenceServiceSpec, replica: int) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    group = group_name(name, replica)
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, group, "ranks", {L_GROUP: str(replica)}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # ranks find rank 0 while the group is still forming
            "selector": {**pod_selector(name), L_GROUP: str(replica)},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                      {"name": "dist", "port": MASTER_PORT, "targetPort": "dist", "protocol": "TCP"}],
        },
    })


def serving_selector(name: str, multi: bool) -> dict[str, str]:
    """The engine pods that serve the OpenAI API: every pod, or rank 0 of each multi-pod group."""
    selector = pod_selector(name)
    if multi:
        selector[L_POD_INDEX] = "0"  # only rank 0 serves the OpenAI API
    return selector


def gateway_service(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool,
                    settings: Settings = Settings()) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    selector = gateway_selector(name) if spec.gateway.enabled else serving_selector(name, multi)
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if spec.gateway.enabled:  # in its EndpointSlices, where the autoscaler finds the gateways' metrics listener
        ports.append(gateway_metrics_service_port())
    else:  # it lists the serving engines: the shared gateway finds their KV-event ports in its slices
        ports += kv_events_service_ports(spec, settings)
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, name, "gateway"),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    })


def _scraper_rules(spec: InferenceServiceSpec, settings: Settings,
                   ports: tuple[int, ...] = (ENGINE_PORT,)) -> list[dict[str, Any]]:
    """Prometheus (and the operator's autoscaler) reach /metrics, served on the HTTP port of engines and gateways
    alike (routes other than health and metrics still need the API key): the operator's namespace, every
    --metrics-namespace and security.networkPolicy.metricsFrom."""
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
                for ns in dict.fromkeys(filter(None, (settings.operator_namespace, *settings.metrics_namespaces)))]
    scrapers += copy.deepcopy(spec.security.network_policy.metrics_from)
    return [{"from": scrapers, "ports": [{"port": p, "protocol": "TCP"} for p in ports]}] if scrapers else []


def network_policy(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings, multi: bool) -> dict:
    name = isvc["metadata"]["name"]
    http = [{"port": ENGINE_PORT, "protocol": "TCP"}]
    if spec.gateway.enabled:  # clients -> gateway -> engines: only the gateway reaches the engines' API
        peers = [{"podSelector": {"matchLabels": gateway_selector(name)}}]
        if spec.inference_pool is not None:  # and the extension's Gateway, which sends straight to the engines
            peers += copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    else:
        peers = copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    peers += shared_gateway_peers(settings)
    rules: list[dict[str, Any]] = [{"from": peers, "ports": http}, *_scraper_rules(spec, settings)]
    # whoever routes by the engines' KV events subscribes to them: the service's own gateway, the shared one
    subscribers = [{"podSelector": {"matchLabels": gateway_selector(name)}}] if precise_prefix(spec) else []
    subscribers += shared_gateway_peers(settings) if shared_gateway_precise(settings) else []
    if subscribers:
        rules.append({"from": subscribers,
                      "ports": [{"port": KV_EVENTS_PORT, "protocol": "TCP"}, {"port": KV_REPLAY_PORT, "protocol": "TCP"}]})
    if spec.engine.enable_lora and settings.operator_namespace:  # the operator reads the adapter-sync sidecars
        rules.append({"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": settings.operator_namespace}}}],
            "ports": [{"port": adapters.SIDECAR_PORT, "protocol": "TCP"}]})
    if multi:
        # torch.distributed: rendezvous on 29500, NCCL/gloo on ephemeral ports -> every port, same service only
        rules.append({"from": [{"podSelector": {"matchLabels": pod_selector(name)}}]})
    return _finish({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, name, "network-policy"),
        "spec": {"podSelector": {"matchLabels": pod_selector(name)}, "policyTypes": ["Ingress"], "ingress": rules},
    })


def prefill_service(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """Headless, for its EndpointSlices: the Ready prefill engines (spec.prefill), which the gateway watches."""
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, prefill_name(name), "prefill"),
        "spec": {"clusterIP": "None", "selector": prefill_selector(name),
                 "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]},
    })


def prefill_network_policy(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    """The prefill engines take requests from the service's gateway (and the shared gateway, which sends prefills
    there too) and KV pulls from its decode engines, on the HTTP port; scrapers reach /metrics as on every engine."""
    name = isvc["metadata"]["name"]
    peers = [{"podSelector": {"matchLabels": gateway_selector(name)}},
             {"podSelector": {"matchLabels": pod_selector(name)}}, *shared_gateway_peers(settings)]
    rules = [{"from": peers, "ports": [{"port": ENGINE_PORT, "protocol": "TCP"}]}, *_scraper_rules(spec, settings)]
    return _finish({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, prefill_name(name), "network-policy"),
        "spec": {"podSelector": {"matchLabels": prefill_selector(name)}, "policyTypes": ["Ingress"], "ingress": rules},
    })


def prefill_disruption_budget(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, prefill_name(name), "disruption-budget"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": prefill_selector(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


def disruption_budget(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, name, "disruption-budget"),
        # one pod at a time: for multi-pod replicas that is one group at a time
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_selector(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


def engines_service(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool,
                    canary_percent: int | None = None, settings: Settings = Settings()) -> dict[str, Any]:
    """Headless: no virtual IP, it exists for its EndpointSlices (Ready serving engines), which the gateway watches.
    With a canary its label L_CANARY_PERCENT carries the canary's share to the gateways (through the slices)."""
    name = isvc["metadata"]["name"]
    extra = {L_CANARY_PERCENT: str(canary_percent)} if canary_percent is not None else None
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, engines_service_name(name), "engines", extra),
        "spec": {
            "clusterIP": "None",
            "selector": serving_selector(name, multi),
            # and the KV-event ports where the engines publish: a gateway learns from the slices which do, and where
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                      *kv_events_service_ports(spec, settings)],
        },
    })


# The gateways' /metrics on a listener of its own, which Istio's sidecar leaves out of its mTLS: the operator's
# autoscaler, outside the mesh, reads the engines' load there when it cannot scrape mesh-only engines
# (spec.autoscaling.loadSource). The port serves /metrics and nothing else; the NetworkPolicy admits only scrapers.
GATEWAY_METRICS_PORT = 9090


def gateway_metrics_service_port() -> dict[str, Any]:
    return {"name": "metrics", "port": GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
