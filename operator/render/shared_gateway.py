"""The shared gateway's reach (`shoal-gateway --namespace/-A`, deployed by the chart): the peers the
engines' NetworkPolicy admits and the Role that lets it wake services that scale from zero. Separate because both
the engines' NetworkPolicy and the per-service gateway children refer to it.
"""

from __future__ import annotations

from typing import Any

from shoal.operator.api import InferenceServiceSpec
from shoal.operator.contract import L_COMPONENT, gateway_name
from shoal.operator.render.common import Settings, _finish, _meta
from shoal.operator.render.configmaps import scales_from_zero


# One `shoal-gateway --namespace/-A` for many InferenceServices (operator/gateway/fleet.py), deployed by the chart and
# named to the operator by --shared-gateway NAMESPACE/SERVICEACCOUNT: it discovers each service's engines through
# <name>-engines like the service's own gateway, so it needs the engines' NetworkPolicy to admit its pods, and, for
# a service that scales from zero, the right to annotate <name>-wake (a RoleBinding to the service's gateway Role,
# which allows nothing else).
SHARED_GATEWAY_COMPONENT = "shared-gateway"


def _shared_gateway_ref(settings: Settings) -> tuple[str, str] | None:
    if not settings.shared_gateway:
        return None
    namespace, _, account = settings.shared_gateway.partition("/")
    return namespace, account


def shared_gateway_peers(settings: Settings) -> list[dict[str, Any]]:
    ref = _shared_gateway_ref(settings)
    if ref is None:
        return []
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ref[0]}},
             "podSelector": {"matchLabels": {L_COMPONENT: SHARED_GATEWAY_COMPONENT}}}]


def shared_gateway_access(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> list[dict]:
    ref = _shared_gateway_ref(settings)
    if ref is None or not scales_from_zero(spec):
        return []
    name = isvc["metadata"]["name"]
    return [_finish({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                     "metadata": _meta(isvc, f"{name}-shared-gateway", "gateway"),
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": gateway_name(name)},
                     "subjects": [{"kind": "ServiceAccount", "name": ref[1], "namespace": ref[0]}]})]
