"""The parts the engine pods and the gateway pods both carry: the restricted security context and probes,
the tracing env, the API-key Secret's volume and mount, the KV-event ports of precise-prefix routing, and the
service-mesh annotations. Separate so that the engine and the gateway modules share them without importing each
other.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from shoal.operator import api
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec, MASTER_PORT
# precise-prefix routing: each engine publishes its KV events (vLLM's format) on these ports of its pod IP, and a
# gateway subscribes to every ready engine there (operator/gateway/kv_subscriber.py)
from shoal.operator.contract import (KV_EVENTS_PORT, KV_EVENTS_PORT_NAME, KV_REPLAY_PORT, KV_REPLAY_PORT_NAME,
                                     kv_events_topic)

if TYPE_CHECKING:
    from shoal.operator.render.common import Settings


def precise_prefix(spec: InferenceServiceSpec) -> bool:
    """The service's own gateway routes by its engines' KV events (it renders the subscriber's flags)."""
    return spec.gateway.enabled and spec.gateway.routing == "precise-prefix"


def shared_gateway_precise(settings: "Settings") -> bool:
    """The chart's shared gateway routes precise-prefix (shoal-operator --shared-gateway-routing): it subscribes to
    the engines of every service it serves."""
    return bool(settings.shared_gateway) and settings.shared_gateway_routing == "precise-prefix"


def publishes_kv_events(spec: InferenceServiceSpec, settings: "Settings") -> bool:
    """The engines publish KV events: their own gateway or the shared gateway reads them."""
    return precise_prefix(spec) or shared_gateway_precise(settings)


def kv_events_config(name: str, namespace: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                       "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": kv_events_topic(name, namespace)},
                      separators=(",", ":"))


def kv_events_ports(spec: InferenceServiceSpec, settings: "Settings") -> list[dict[str, Any]]:
    """The engine container's KV-event ports (named: the engines' Service refers to them by name)."""
    if not publishes_kv_events(spec, settings):
        return []
    return [{"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": KV_REPLAY_PORT_NAME, "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]


def kv_events_service_ports(spec: InferenceServiceSpec, settings: "Settings") -> list[dict[str, Any]]:
    """The same ports on the Service that lists the serving engines: its EndpointSlices tell the shared gateway
    which engines publish, and where (operator/gateway/fleet.py)."""
    return [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
            for p in kv_events_ports(spec, settings)]


def _probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _restricted_container(add_capabilities=()) -> dict[str, Any]:
    """A container securityContext that passes the "restricted" Pod Security Standard (plus any capabilities the
    spec adds back)."""
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"], **({"add": list(add_capabilities)} if add_capabilities else {})},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def traces_url(tracing: api.Tracing) -> str:
    return tracing.endpoint.rstrip("/") + "/v1/traces"


def tracing_env(isvc: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """spec.tracing as the standard OpenTelemetry variables, which the engine and the gateway (and vLLM's
    exporter) read: where to (OTLP/HTTP), how much (a parent-based ratio: a caller's sampled traceparent is always
    followed, so one trace spans gateway and engine), the collector's headers from their Secret, and which
    InferenceService the spans come from."""
    t = spec.tracing
    if t is None:
        return []
    meta = isvc["metadata"]
    env = [{"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "value": traces_url(t)},
           {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"},
           {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
           {"name": "OTEL_TRACES_SAMPLER_ARG", "value": repr(float(t.sampling_ratio))},
           {"name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"k8s.namespace.name={meta['namespace']},shoal.inferenceservice={meta['name']}"}]
    if t.headers_secret_ref is not None:
        ref = t.headers_secret_ref
        env.append({"name": "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


API_KEYS_DIR = "/etc/shoal/api-keys"  # the engines' key Secret, mounted: re-read on rotation (--api-key-file)
API_KEYS_FILE = f"{API_KEYS_DIR}/keys"


def _key_file(spec: InferenceServiceSpec) -> bool:
    """Shoal's engine takes its keys from the mounted Secret (every line a key, re-read when the kubelet updates
    the volume): a rotation needs no restart of GPU pods. Other runtimes read one key from their env var."""
    return spec.security.api_key_secret_ref is not None and spec.runtime == "shoal"


def api_key_volume(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    ref = spec.security.api_key_secret_ref
    return [{"name": "api-keys", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": "keys"}]}}] \
        if ref else []


API_KEYS_MOUNT = {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}


# Istio's sidecar sits in front of every port of a pod. Under STRICT mTLS a rank's torch.distributed traffic — the
# rendezvous on MASTER_PORT, NCCL/gloo sockets on ephemeral ports — reaches its peers by pod IP, which the
# sidecars pass through as plaintext and the peer's sidecar then refuses. So only the OpenAI port is captured
# inbound (mTLS for the gateway's requests), the rendezvous port bypasses the sidecar outbound, and the ephemeral
# ports, captured by no one inbound, arrive as they were sent. (With outboundTrafficPolicy REGISTRY_ONLY add the
# pod CIDR to traffic.sidecar.istio.io/excludeOutboundIPRanges through spec.pod.annotations.) Harmless without Istio.
A_ISTIO_INCLUDE_INBOUND = "traffic.sidecar.istio.io/includeInboundPorts"
A_ISTIO_EXCLUDE_OUTBOUND = "traffic.sidecar.istio.io/excludeOutboundPorts"
A_ISTIO_EXCLUDE_INBOUND = "traffic.sidecar.istio.io/excludeInboundPorts"


def mesh_annotations() -> dict[str, str]:
    """Pod annotations of multi-pod groups that keep inter-rank traffic out of a service mesh's sidecar."""
    return {A_ISTIO_INCLUDE_INBOUND: str(ENGINE_PORT), A_ISTIO_EXCLUDE_OUTBOUND: str(MASTER_PORT)}
