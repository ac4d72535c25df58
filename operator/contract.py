"""The InferenceService contract: what the operator writes and every reader of the fleet reads by.

Names of the children (the engines Service, the gateway, the ConfigMaps), their labels and annotation keys, the
defaults a reader needs without the spec's model (the served model name rule, the startup-timeout default) and the
gateway metric names the autoscaler scrapes. The operator renders by these (render/, adapters.py, api.py); the
autoscaler and the gateway (fleet.ServiceView, wake.py) read by them. Plain constants and functions over plain
values: the gateway imports this module alone, without the spec's pydantic models.
"""

from __future__ import annotations

# ---- the resource ------------------------------------------------------------------------------------------------
GROUP = "serving.shoal.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

# ---- labels (on every child; Services' labels reach their EndpointSlices) ---------------------------------------
L_NAME = "app.kubernetes.io/name"
L_INSTANCE = "app.kubernetes.io/instance"
L_COMPONENT = "app.kubernetes.io/component"
L_MANAGED_BY = "app.kubernetes.io/managed-by"
L_PART_OF = "app.kubernetes.io/part-of"
L_ISVC = f"{GROUP}/inferenceservice"
L_GROUP = f"{GROUP}/group"
L_POD_INDEX = "apps.kubernetes.io/pod-index"
L_SERVICE_NAME = "kubernetes.io/service-name"  # set by the EndpointSlice controller on a Service's slices
# Canary revisions (spec.canary): the canary's engine pods carry L_CANARY=true (the stable ones carry none, so
# existing Deployments keep their template); the engines Service carries the canary's traffic share as a label,
# which reaches its EndpointSlices (the EndpointSlice controller copies a Service's labels), so every gateway
# replica reads the split with the endpoints, on the same watch, without a restart.
L_CANARY = f"{GROUP}/canary"
L_CANARY_PERCENT = f"{GROUP}/canary-percent"
STABLE, CANARY = "stable", "canary"
MANAGED_BY = "shoal-operator"
MANAGED_SELECTOR = f"{L_MANAGED_BY}={MANAGED_BY}"

# ---- annotations ---------------------------------------------------------------------------------------------------
A_SPEC_HASH = f"{GROUP}/spec-hash"  # of a rendered child, compared by the reconciler
A_GROUP_SIZE = f"{GROUP}/group-size"
A_REVISION = f"{GROUP}/revision"  # of a group's template, independent of its index (rollout.py)
A_WAKE = f"{GROUP}/wake-requested-at"  # on <name>-wake: a gateway holds requests at zero replicas
A_SLEEPING = f"{GROUP}/sleeping"  # on an engine pod parked asleep (scaleToZero sleep): its sleep level
A_UPGRADE = f"{GROUP}/upgrade-engine-image"  # on the InferenceService: move it to the operator's engine image now

# ---- the pod's layout ----------------------------------------------------------------------------------------------
MODELS_DIR = "/models"  # where a pvc:// model's (and a pvc:// adapter's) claim is mounted

# ---- defaults a reader needs -------------------------------------------------------------------------------------
DEFAULT_STARTUP_TIMEOUT_SECONDS = 1800  # spec.probes.startupTimeoutSeconds: also how long a request waits at zero
HF_SCHEME = "hf://"


def served_model_name(name: str, uri: str, served_name: str | None) -> str:
    """The model name clients send: spec.model.servedName, else the hub id of an hf:// model, else the service's
    name. The operator also writes it to status.servedModelName."""
    if served_name:
        return served_name
    if uri.startswith(HF_SCHEME):
        return uri[len(HF_SCHEME):]
    return name


# ---- names of the children -----------------------------------------------------------------------------------------
def engines_service_name(name: str) -> str:
    """The headless Service of the rank-0 engine pods behind the service's own gateway."""
    return f"{name}-engines"


def serving_engines_service(name: str, gateway_enabled: bool) -> str:
    """The Service whose EndpointSlices list the serving (rank-0) engine pods: `<name>` itself without a gateway."""
    return engines_service_name(name) if gateway_enabled else name


# ---- KV events (precise-prefix routing) ----------------------------------------------------------------------------
# Each engine publishes its KV events (vLLM's format) on these ports of its pod IP, under the topic of its service;
# the engines' Service names them (KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME), so its EndpointSlices tell a gateway
# which engines publish and where (the shared gateway subscribes only to those).
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"


def kv_events_topic(name: str, namespace: str) -> str:
    """The topic an InferenceService's engines publish under: a subscriber filtering by it never indexes another
    service's events, even at an address a pod of that service held a moment ago."""
    return f"kv@{namespace}/{name}"


def prefill_name(name: str) -> str:
    """spec.prefill's Deployment and the headless Service listing its pods (the gateway sends prefills there)."""
    return f"{name}-prefill"


def canary_name(name: str) -> str:
    """The canary revision's Deployment; its pods are named `<name>-canary-<hash>-<suffix>`."""
    return f"{name}-canary"


def endpoint_revision(isvc: str | None, pod: str | None) -> str:
    """The revision of an engine endpoint, from its EndpointSlice targetRef (the pod's name), which is all an
    EndpointSlice says of the pod. Unambiguous: the pods of the stable Deployment are `<name>-<template hash>-...`,
    and a template hash never spells "canary" (its alphabet has no vowels); the pods of an InferenceService named
    `<name>-canary` are not behind `<name>`'s engines Service."""
    return CANARY if isvc and pod and pod.startswith(f"{canary_name(isvc)}-") else STABLE


def gateway_name(name: str) -> str:
    """The gateway's Deployment, ServiceAccount, Role, PodDisruptionBudget and NetworkPolicy."""
    return f"{name}-gateway"


def wake_configmap_name(name: str) -> str:
    """The ConfigMap a holding gateway annotates (A_WAKE) to wake the autoscaler."""
    return f"{name}-wake"


def adapters_configmap_name(name: str) -> str:
    """The ConfigMap of spec.adapters, mounted by every engine pod (read by the adapter-sync sidecar)."""
    return f"{name}-adapters"


# ---- the gateway's metrics the autoscaler reads (operator/gateway/metrics.py exports them) ----------------------
GATEWAY_METRIC_PREFIX = "shoal:gateway_"
GATEWAY_HELD_REQUESTS = GATEWAY_METRIC_PREFIX + "held_requests"
GATEWAY_INFLIGHT_REQUESTS = GATEWAY_METRIC_PREFIX + "inflight_requests"  # per engine: label `backend`
# batch requests not finished (waiting for capacity or at an engine), label `model`: keeps the service awake
GATEWAY_BATCH_PENDING_REQUESTS = GATEWAY_METRIC_PREFIX + "batch_pending_requests"
# per engine (label `backend`): the engine's own load as the gateway last polled it -> the autoscaler's field
GATEWAY_ENGINE_GAUGES = {GATEWAY_METRIC_PREFIX + "backend_running_requests": "running",
                         GATEWAY_METRIC_PREFIX + "backend_waiting_requests": "waiting",
                         GATEWAY_METRIC_PREFIX + "backend_kv_cache_usage": "kv_usage",
                         GATEWAY_METRIC_PREFIX + "backend_waiting_prefill_tokens": "waiting_prefill_tokens"}
# per revision (label `revision`: stable | canary): what the canary's rollback SLO is judged on (canary_judge.py)
GATEWAY_REVISION_REQUESTS = GATEWAY_METRIC_PREFIX + "revision_requests"  # counter; label `outcome`: ok|error
GATEWAY_REVISION_FIRST_BYTE = GATEWAY_METRIC_PREFIX + "revision_first_byte_seconds"  # histogram
