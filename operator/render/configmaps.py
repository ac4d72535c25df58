"""The ConfigMaps an InferenceService owns: the wake ConfigMap of a service that scales from zero (the
gateways write it, the operator watches it), the adapters ConfigMap the pods' adapter-sync sidecar reads, and the
chat template the engines mount. Separate because they carry data rather than workloads, and both the engine pod
and the gateway refer to them by name.
"""

from __future__ import annotations

from typing import Any

from shoal.operator import adapters
from shoal.operator.api import InferenceServiceSpec
from shoal.operator.contract import wake_configmap_name
from shoal.operator.render.common import _finish, _meta


CHAT_TEMPLATE_DIR = "/etc/shoal/chat-template"
CHAT_TEMPLATE_KEY = "template.jinja"


def scales_from_zero(spec: InferenceServiceSpec) -> bool:
    return spec.autoscaling is not None and spec.autoscaling.min_replicas == 0


def wake_configmap(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """The object a holding gateway annotates to wake the autoscaler (operator/gateway/wake.py): its own, so the
    gateway needs no write access to the InferenceService. The operator renders no annotations of its own here,
    so server-side apply leaves the gateway's alone."""
    return _finish({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, wake_configmap_name(isvc["metadata"]["name"]), "wake"),
        "data": {"purpose": "shoal-gateway annotates this ConfigMap to wake the autoscaler (scale from zero)"},
    })


def adapters_configmap(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """spec.adapters as the pods' adapter-sync sidecars read it (mounted; the kubelet refreshes it in place)."""
    return _finish({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, adapters.configmap_name(isvc["metadata"]["name"]), "adapters"),
        "data": {adapters.CONFIG_KEY: adapters.config(spec)},
    })


def chat_template_configmap(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, f"{name}-chat-template", "chat-template"),
        "data": {CHAT_TEMPLATE_KEY: spec.model.chat_template or ""},
    })
