"""JSON Schemas of the Gateway API Inference Extension's InferencePool and of the Gateway API's HTTPRoute, written
here from their published CRDs' field definitions (no file of either project is copied): the fields the operator
renders, with the published types, enums, patterns, bounds and required lists, plus the CEL rules on those fields
as Python checks. Every object is closed (additionalProperties: false), as the API server's strict field
validation treats unknown fields, so a misspelt or invented field fails here too.

  InferencePool  inference.networking.k8s.io/v1  gateway-api-inference-extension v1.6.0
                 (commit 992e5c292afb248801ce8d9234eb5b9d28eea231,
                 config/crd/bases/inference.networking.k8s.io_inferencepools.yaml)
  HTTPRoute      gateway.networking.k8s.io/v1    gateway-api v1.6.1
                 (commit 8bb74df00e56ec8f944d48c25e6c1c9c2f6848e3,
                 config/crd/standard/gateway.networking.k8s.io_httproutes.yaml)
"""

from __future__ import annotations

from typing import Any

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GROUP = {"type": "string", "maxLength": 253,
         "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
NAMESPACE = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
PORT_OBJECT = {"type": "object", "additionalProperties": False, "required": ["number"], "properties": {"number": PORT}}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
HEADER_NAME = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"}


def _metadata() -> dict[str, Any]:
    # the object metadata the operator sets (ObjectMeta itself is the API server's; names are DNS subdomains)
    return {"type": "object", "required": ["name", "namespace"], "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
        "namespace": NAMESPACE, "labels": {"type": "object"}, "annotations": {"type": "object"},
        "ownerReferences": {"type": "array"}}, "additionalProperties": False}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A whole object of `kind`: apiVersion, kind, metadata and `spec`, nothing else."""
    return {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _metadata(),
                       "spec": spec},
    }


INFERENCE_POOL: dict[str, Any] = _resource(
    "inference.networking.k8s.io/v1", "InferencePool",
        {"type": "object", "required": ["selector", "targetPorts"], "additionalProperties": False,
                 "properties": {
                     "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                     "endpointPickerRef": {
                         "type": "object", "required": ["name"], "additionalProperties": False,
                         "properties": {"failureMode": {"enum": ["FailOpen", "FailClose"]}, "group": GROUP,
                                        "kind": KIND, "name": NAME, "port": PORT_OBJECT}},
                     "selector": {
                         "type": "object", "required": ["matchLabels"], "additionalProperties": False,
                         "properties": {"matchLabels": {
                             "type": "object", "minProperties": 1, "maxProperties": 64,
                             "additionalProperties": {"type": "string", "maxLength": 63,
                                                      "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT_OBJECT},
                 }},
)

HTTP_ROUTE: dict[str, Any] = _resource(
    "gateway.networking.k8s.io/v1", "HTTPRoute",
        {"type": "object", "additionalProperties": False, "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"group": GROUP, "kind": KIND, "name": NAME, "namespace": NAMESPACE, "port": PORT,
                               "sectionName": {"type": "string", "minLength": 1, "maxLength": 253,
                                               "pattern": DNS_SUBDOMAIN}}}},
            "hostnames": {"type": "array", "maxItems": 16, "items": {
                "type": "string", "minLength": 1, "maxLength": 253,
                "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 253, "pattern": DNS_SUBDOMAIN},
                    "matches": {"type": "array", "maxItems": 64, "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "path": {"type": "object", "additionalProperties": False, "properties": {
                                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                "value": {"type": "string", "maxLength": 1024}}},
                            "headers": {"type": "array", "maxItems": 16, "items": {
                                "type": "object", "required": ["name", "value"], "additionalProperties": False,
                                "properties": {"type": {"enum": ["Exact", "RegularExpression"]},
                                               "name": HEADER_NAME,
                                               "value": {"type": "string", "minLength": 1, "maxLength": 4096}}}},
                            "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                                                "TRACE", "PATCH"]}}}},
                    "backendRefs": {"type": "array", "maxItems": 16, "items": {
                        "type": "object", "required": ["name"], "additionalProperties": False,
                        "properties": {"group": GROUP, "kind": KIND, "name": NAME, "namespace": NAMESPACE,
                                       "port": PORT, "weight": {"type": "integer", "minimum": 0,
                                                                "maximum": 1000000}}}},
                    "timeouts": {"type": "object", "additionalProperties": False,
                                 "properties": {"request": DURATION, "backendRequest": DURATION}}}}},
        }},
)


def cel_errors(obj: dict[str, Any]) -> list[str]:
    """The published CEL rules (x-kubernetes-validations) on the fields rendered, checked in Python."""
    errors = []
    spec = obj.get("spec") or {}
    if obj["kind"] == "InferencePool":
        ref = spec.get("endpointPickerRef")
        if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
            errors.append("endpointPickerRef: port is required when kind is 'Service' or unspecified")
        numbers = [p["number"] for p in spec.get("targetPorts") or []]
        if len(numbers) != len(set(numbers)):
            errors.append("targetPorts: port number must be unique")
    if obj["kind"] == "HTTPRoute":
        rules = spec.get("rules") or []
        if sum(len(r.get("matches") or []) for r in rules) > 128:
            errors.append("rules: more than 128 matches in all")
        for rule in rules:
            for match in rule.get("matches") or []:
                path = match.get("path") or {}
                if path.get("type", "PathPrefix") in ("Exact", "PathPrefix"):
                    value = path.get("value", "/")
                    if not value.startswith("/") or "//" in value:
                        errors.append(f"path {value!r}: must be an absolute path without '//'")
            for ref in rule.get("backendRefs") or []:
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" not in ref:
                    errors.append("backendRefs: Must have port for Service reference")
        refs = [(p.get("group", "gateway.networking.k8s.io"), p.get("kind", "Gateway"), p["name"],
                 p.get("namespace", ""), p.get("sectionName", "")) for p in spec.get("parentRefs") or []]
        if len(refs) != len(set(refs)):
            errors.append("parentRefs: sectionName must be unique when parentRefs includes 2 or more references "
                          "to the same parent")
    return errors
