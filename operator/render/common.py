"""The pieces every rendered child shares: the operator's Settings, the label scheme and selectors, and the
metadata every child carries (ownerReference, labels, the spec-hash annotation that `_finish` stamps). Separate
because each child-kind module builds on these and on nothing else of the others.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from shoal.operator import api
from shoal.operator.contract import (A_SPEC_HASH, L_COMPONENT, L_INSTANCE, L_ISVC, L_MANAGED_BY, L_NAME, L_PART_OF,
                                     MANAGED_BY)


DEFAULT_ENGINE_IMAGE = "ghcr.io/shoal-dev/shoal-engine:0.1.0"
# shoal-gateway needs no torch: the operator's small image (Dockerfile.operator) carries it.
DEFAULT_GATEWAY_IMAGE = "ghcr.io/shoal-dev/shoal-operator:0.1.0"
# The pods' helper containers (shoal-podtools: the model download, the adapter sync) run from the operator image,
# whatever the engine's runtime: the engine image carries no operator code.
DEFAULT_FLEET_IMAGE = "ghcr.io/shoal-dev/shoal-operator:0.1.0"
PODTOOLS = "shoal-podtools"


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (CLI flags of shoal-operator)."""

    engine_image: str = DEFAULT_ENGINE_IMAGE
    gateway_image: str = DEFAULT_GATEWAY_IMAGE
    fleet_image: str = DEFAULT_FLEET_IMAGE  # the pods' helper containers (shoal-podtools)
    max_gpus_per_node: int = 8
    cluster_domain: str = "cluster.local"
    operator_namespace: str | None = None  # metrics scraping allowed from there by the NetworkPolicy
    metrics_namespaces: tuple[str, ...] = ()  # Prometheus' namespaces: admitted like the operator's
    prestop_seconds: int = 5
    run_as_user: int = 1000
    max_concurrent_upgrades: int = 1  # services moved to a new default engine image at once (upgrade.py)
    # The shared gateway (`shoal-gateway --namespace/-A`, deployed by the chart) as "namespace/serviceaccount": its
    # pods (component shared-gateway there) reach every engine, and it may wake services that scale from zero.
    shared_gateway: str | None = None
    # Its --routing (the chart's sharedGateway.routing): precise-prefix makes every service's engines publish their
    # KV events to it (render/containers.py publishes_kv_events)
    shared_gateway_routing: str | None = None


def group_name(name: str, replica: int) -> str:
    return f"{name}-g{replica}"


def pod_selector(name: str) -> dict[str, str]:
    return {L_ISVC: name, L_COMPONENT: "engine"}


def prefill_selector(name: str) -> dict[str, str]:
    return {L_ISVC: name, L_COMPONENT: "prefill"}


def gateway_selector(name: str) -> dict[str, str]:
    return {L_ISVC: name, L_COMPONENT: "gateway"}


def labels(name: str, component: str) -> dict[str, str]:
    return {
        L_NAME: "shoal-engine" if component == "engine" else "shoal",
        L_INSTANCE: name,
        L_COMPONENT: component,
        L_MANAGED_BY: MANAGED_BY,
        L_PART_OF: "shoal",
        L_ISVC: name,
    }


def spec_hash(obj: dict[str, Any]) -> str:
    content = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    content["labels"] = obj.get("metadata", {}).get("labels", {})
    raw = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _meta(isvc: dict[str, Any], name: str, component: str, extra_labels: dict[str, str] | None = None) -> dict:
    meta = isvc["metadata"]
    owner = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": {**labels(meta["name"], component), **(extra_labels or {})},
        "ownerReferences": [owner],
    }


def _finish(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[A_SPEC_HASH] = spec_hash(obj)
    return obj
