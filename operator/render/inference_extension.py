"""The Gateway API inference extension's objects (spec.inferencePool): the InferencePool over the
serving pods and the HTTPRoutes that send each served model name to it. Separate because they are optional CRDs
of a platform, not children every service has.
"""

from __future__ import annotations

from typing import Any

from shoal.operator import api
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec
from shoal.operator.render.common import _finish, _meta
from shoal.operator.render.network import serving_selector


# For a Gateway that runs the inference extension (spec.inferencePool): an InferencePool of the serving engine pods
# (inference.networking.k8s.io/v1, as published by gateway-api-inference-extension v1.6.0) whose endpoint picker is
# the user's, and optionally an HTTPRoute (gateway.networking.k8s.io/v1, gateway-api v1.6.1) from the user's
# Gateway to it. The picker reads the engines' vllm:* metrics, which Shoal's engine exports.
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
MODEL_NAME_HEADER = "X-Gateway-Model-Name"  # set from the body's `model` by the extension's body-based router


def served_names(isvc: dict[str, Any], spec: InferenceServiceSpec) -> list[str]:
    """The model names this service answers to: its served name and its adapters'."""
    return [api.served_model_name(isvc["metadata"]["name"], spec), *(a.name for a in spec.adapters)]


def inference_pool(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool) -> dict[str, Any]:
    pool = spec.inference_pool
    assert pool is not None
    picker = pool.endpoint_picker
    return _finish({
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(isvc, isvc["metadata"]["name"], "inference-pool"),
        "spec": {
            "selector": {"matchLabels": serving_selector(isvc["metadata"]["name"], multi)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": picker.name, "port": {"number": picker.port},
                                  "failureMode": picker.failure_mode},
        },
    })


# The Gateway API's bounds on one HTTPRoute: 64 matches per rule, 16 rules, 128 matches in all (a CEL rule)
ROUTE_MATCHES_PER_RULE = 64
ROUTE_MATCHES = 128


def route_name(name: str, index: int) -> str:
    return name if index == 0 else f"{name}-r{index + 1}"


def http_routes(isvc: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The HTTPRoutes from the user's Gateway to the pool: with matchModelHeader one match per served name (the
    model and up to 256 adapters), in rules of at most 64 matches and routes of at most 128 (`<name>`,
    `<name>-r2`, `<name>-r3`); without it one match for every path."""
    route = spec.inference_pool.http_route if spec.inference_pool else None
    assert route is not None
    name = isvc["metadata"]["name"]
    parents = []
    for ref in route.parent_refs:
        parent = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ref.name}
        if ref.namespace:
            parent["namespace"] = ref.namespace
        if ref.section_name:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    backend = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
    if route.match_model_header:
        matches = [{"path": {"type": "PathPrefix", "value": "/"},
                    "headers": [{"type": "Exact", "name": MODEL_NAME_HEADER, "value": model}]}
                   for model in served_names(isvc, spec)]
    else:
        matches = [{"path": {"type": "PathPrefix", "value": "/"}}]
    routes = []
    for index, start in enumerate(range(0, len(matches), ROUTE_MATCHES)):
        mine = matches[start:start + ROUTE_MATCHES]
        # a whole non-streaming generation, as Shoal's gateway allows (spec.gateway.responseTimeoutSeconds)
        rules = [{"matches": mine[i:i + ROUTE_MATCHES_PER_RULE], "backendRefs": [backend],
                  "timeouts": {"request": f"{spec.gateway.response_timeout_seconds}s"}}
                 for i in range(0, len(mine), ROUTE_MATCHES_PER_RULE)]
        body: dict[str, Any] = {"parentRefs": parents, "rules": rules}
        if route.hostnames:
            body["hostnames"] = list(route.hostnames)
        routes.append(_finish({"apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute",
                               "metadata": _meta(isvc, route_name(name, index), "http-route"), "spec": body}))
    return routes


def inference_extension_children(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool) -> list[dict]:
    children = [inference_pool(isvc, spec, multi)]
    if spec.inference_pool is not None and spec.inference_pool.http_route is not None:
        children += http_routes(isvc, spec)
    return children
