"""The per-InferenceService shoal-gateway (spec.gateway): its Deployment and sizing, RBAC, NetworkPolicy,
PodDisruptionBudget and the batches claim. Separate because the gateway is a component of its own (it runs from the
operator image) whose children come and go with spec.gateway.enabled.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from shoal.operator import api, contract
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec
from shoal.operator.gateway import options as gateway_options
from shoal.operator.gateway.proxy import GatewayConfig
from shoal.operator.contract import engines_service_name, gateway_name, prefill_name, wake_configmap_name
from shoal.operator.render.common import Settings, _finish, _meta, gateway_selector, labels
from shoal.operator.render.containers import (API_KEYS_FILE, API_KEYS_MOUNT, A_ISTIO_EXCLUDE_INBOUND, KV_EVENTS_PORT,
                                              KV_REPLAY_PORT, _probe, _restricted_container, api_key_volume,
                                              kv_events_topic, precise_prefix, tracing_env)
from shoal.operator.render.configmaps import scales_from_zero, wake_configmap
from shoal.operator.render.network import GATEWAY_METRICS_PORT, _scraper_rules, engines_service


GATEWAY_UID = 65532  # the operator image's user


def gateway_rbac(isvc: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The gateway's identity: it may list and watch EndpointSlices in its namespace, read its own InferenceService
    (spec.adapters: gateway/own_service.py), and, when the fleet can scale to zero, patch its wake-up ConfigMap to
    wake the autoscaler (operator/gateway/wake.py); nothing else."""
    name = isvc["metadata"]["name"]
    gw = gateway_name(name)
    rules = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
             # its own InferenceService, read by name (shoal-gateway --inference-service): the adapters it declares
             {"apiGroups": [contract.GROUP], "resources": [contract.PLURAL], "resourceNames": [name],
              "verbs": ["get", "list", "watch"]}]
    if scales_from_zero(spec):
        rules.append({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [wake_configmap_name(name)],
                      "verbs": ["patch"]})
    return [
        _finish({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(isvc, gw, "gateway"),
                 "automountServiceAccountToken": False}),  # mounted by the gateway pod alone
        _finish({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(isvc, gw, "gateway"),
                 "rules": rules}),
        _finish({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": _meta(isvc, gw, "gateway"),
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": gw},
                 "subjects": [{"kind": "ServiceAccount", "name": gw, "namespace": isvc["metadata"]["namespace"]}]}),
    ]


def gateway_metrics_listener() -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """(the gateway's args, its container port, its pod annotations) for the metrics listener."""
    return (["--metrics-port", str(GATEWAY_METRICS_PORT)],
            {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
            {A_ISTIO_EXCLUDE_INBOUND: str(GATEWAY_METRICS_PORT)})


def gateway_limit_args(gw: api.GatewayOptions) -> list[str]:
    """spec.gateway's shoal-gateway options (routing, timeouts, admission limits) as its flags: the declaration on
    GatewayConfig says which field is which flag (gateway/options.py)."""
    return gateway_options.to_args(GatewayConfig, gw)


# What one gateway process holds at most (operator/gateway): the interpreter with aiohttp and prometheus_client, the
# prefix index at its cap (200,000 hashes: 63 MiB measured with tracemalloc, one engine a hash; 512 B a hash
# leaves room for hashes several engines hold), the
# request bodies (max_buffered_bytes, kept until the answer starts) and per pending request its connection, task,
# parsed headers and relay buffers.
GATEWAY_BASE_BYTES = 160 * 2**20
GATEWAY_INDEX_BYTES = 200_000 * 512
GATEWAY_PER_REQUEST_BYTES = 32 * 2**10
# gateway.batches: a batch's parsed requests stay in memory while it runs (~3x its input file, measured on chat
# lines) and an input file being checked is read whole: room for one largest file (200 MiB) running and another
# being checked. Several large batches at once need gateway.resources.memory.
GATEWAY_BATCH_BYTES = 4 * 200 * 2**20


def gateway_memory(gw: api.GatewayOptions) -> str:
    """The gateway's memory request and limit: spec.gateway.resources.memory, else the sum of its bounds."""
    if gw.resources.memory is not None:
        return str(gw.resources.memory)
    total = (GATEWAY_BASE_BYTES + GATEWAY_INDEX_BYTES + gw.max_buffered_bytes
             + gw.max_pending * GATEWAY_PER_REQUEST_BYTES + (GATEWAY_BATCH_BYTES if gw.batches.enabled else 0))
    return f"{math.ceil(total / 2**20)}Mi"


GATEWAY_BATCH_DIR = "/var/lib/shoal-gateway/batches"  # the gateway's --batch-dir, on the batch volume


def batches_claim_name(name: str) -> str:
    return f"{name}-gateway-batches"


def gateway_batches_claim(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """The gateway's batch volume (gateway.batches): owned by the InferenceService, not by the gateway's
    Deployment, so users' files and results outlive every gateway roll and go with the service."""
    b = spec.gateway.batches
    claim: dict[str, Any] = {"accessModes": [b.access_mode], "resources": {"requests": {"storage": str(b.size)}}}
    if b.storage_class_name:
        claim["storageClassName"] = b.storage_class_name
    return _finish({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(isvc, batches_claim_name(isvc["metadata"]["name"]), "gateway-batches"),
        "spec": claim,
    })


def gateway_batches_volume(name: str, spec: InferenceServiceSpec) -> tuple[list[str], dict, dict]:
    """(args, volume, volumeMount) of the batch volume."""
    claim = spec.gateway.batches.existing_claim or batches_claim_name(name)
    return (["--batch-dir", GATEWAY_BATCH_DIR], {"name": "batches", "persistentVolumeClaim": {"claimName": claim}},
            {"name": "batches", "mountPath": GATEWAY_BATCH_DIR})


def gateway_deployment(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
    gw, res = spec.gateway, spec.gateway.resources
    memory = gateway_memory(gw)
    requests = {"memory": memory, **({"cpu": str(res.cpu)} if res.cpu is not None else {})}
    resources: dict[str, Any] = {"requests": requests, "limits": {"memory": memory}}
    # In-flight streams may run as long as the engines' drain allows.
    drain = spec.engine.shutdown_timeout_seconds
    hold_args: list[str] = []
    if scales_from_zero(spec):
        # At zero replicas requests wait for the first engine — a GPU node to be provisioned, the image pulled,
        # the model loaded: its whole model-load budget — and the gateway wakes the autoscaler at once by
        # annotating its wake-up ConfigMap.
        hold = spec.probes.startup_timeout_seconds
        hold_args = ["--hold-timeout", str(hold), "--wake-configmap", wake_configmap_name(name)]
        if spec.autoscaling.scale_to_zero == "sleep":  # a held request wakes a parked engine directly
            hold_args.append("--wake-engines")
    metrics_args, metrics_port, metrics_annotations = gateway_metrics_listener()
    volumes, mounts = (api_key_volume(spec), [API_KEYS_MOUNT]) if spec.security.api_key_secret_ref else ([], [])
    batch_args: list[str] = []
    if gw.batches.enabled:
        batch_args, volume, mount = gateway_batches_volume(name, spec)
        volumes, mounts = [*volumes, volume], [*mounts, mount]
    container = {
        "name": "gateway",
        "image": gw.image or settings.gateway_image,
        "command": ["shoal-gateway"],
        "args": ["--service", engines_service_name(name), "--namespace", namespace, "--inference-service", name,
                 "--port-name", "http",
                 "--port", str(ENGINE_PORT), "--shutdown-timeout", str(drain)]
                + gateway_limit_args(gw) + hold_args + metrics_args + batch_args
                # prefill/decode disaggregation: each completion's prefill to the prefill engines first
                + (["--prefill-service", prefill_name(name)] if spec.prefill is not None else [])
                # which readiness path and load metrics the engines have (metric_names.py); shoal's are the default
                # the engines' keys, every line of the mounted Secret, re-read when it is rotated
                + (["--api-key-file", API_KEYS_FILE] if spec.security.api_key_secret_ref else [])
                # engines that schedule by priority get the gateway's, never a client's (proxy.engine_body)
                + (["--engine-priority"] if spec.engine.scheduling_policy == "priority" else [])
                + (["--runtime", spec.runtime] if spec.runtime != "shoal" else [])
                + (["--kv-events-port", str(KV_EVENTS_PORT), "--kv-events-replay-port", str(KV_REPLAY_PORT),
                    "--kv-events-topic", kv_events_topic(name, namespace)] if precise_prefix(spec) else []),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}, metrics_port],
        **({"env": env} if (env := tracing_env(isvc, spec)) else {}),
        # The engines' keys, so the gateway answers 401 itself: an unauthenticated request is never held, never
        # counted as load and never wakes the autoscaler; the batch volume.
        **({"volumeMounts": mounts} if mounts else {}),
        "resources": resources,
        "readinessProbe": _probe("/readyz", 2, 2, 2),
        "livenessProbe": _probe("/livez", 10, 3, 5),
        "lifecycle": {"preStop": {"sleep": {"seconds": settings.prestop_seconds}}},
        "securityContext": _restricted_container(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "serviceAccountName": gateway_name(name),
        "automountServiceAccountToken": True,  # it watches EndpointSlices
        "enableServiceLinks": False,
        "containers": [container],
        "terminationGracePeriodSeconds": drain + settings.prestop_seconds + 15,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": GATEWAY_UID,
            "runAsGroup": GATEWAY_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Replicas on different nodes when possible: one node going away keeps the API up.
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": gateway_selector(name)}}],
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if volumes:
        pod_spec["volumes"] = volumes
    if gw.batches.enabled:  # the batch volume is writable by the gateway's group; chown only a new volume
        pod_spec["securityContext"].update({"fsGroup": GATEWAY_UID, "fsGroupChangePolicy": "OnRootMismatch"})
    return _finish({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, gateway_name(name), "gateway"),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": gateway_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels(name, "gateway"), "annotations": metrics_annotations},
                         "spec": pod_spec},
        },
    })


def gateway_network_policy(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict:
    """Clients (`allowFrom`, else only the namespace's pods: an ingress controller in another namespace needs an
    allowFrom peer) reach the gateway; the metrics scrapers, as for the engines, its /metrics."""
    name = isvc["metadata"]["name"]
    http = [{"port": ENGINE_PORT, "protocol": "TCP"}]
    peers = copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    rules: list[dict[str, Any]] = [{"from": peers, "ports": http},
                                   *_scraper_rules(spec, settings, ports=(ENGINE_PORT, GATEWAY_METRICS_PORT))]
    return _finish({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, gateway_name(name), "network-policy"),
        "spec": {"podSelector": {"matchLabels": gateway_selector(name)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    })


def gateway_disruption_budget(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, gateway_name(name), "disruption-budget"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": gateway_selector(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


def gateway_children(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings,
                     multi: bool, canary_percent: int | None = None) -> list[dict[str, Any]]:
    children = [engines_service(isvc, spec, multi, canary_percent, settings), *gateway_rbac(isvc, spec),
                gateway_deployment(isvc, spec, settings), gateway_disruption_budget(isvc, spec)]
    if scales_from_zero(spec):
        children.append(wake_configmap(isvc, spec))
    if spec.gateway.batches.enabled and not spec.gateway.batches.existing_claim:
        children.append(gateway_batches_claim(isvc, spec))
    if spec.security.network_policy.enabled:
        children.append(gateway_network_policy(isvc, spec, settings))
    return children
