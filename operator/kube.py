"""The few Kubernetes API calls the handlers make, in one place.

Verbs used: get, list, watch (kopf's watch streams and indexes, the autoscaler's informers), create (Events),
patch and delete. The calls go through the fleet half's one client (shoal.operator.k8s); `Kube` maps kinds to
paths for them.

Children are written with server-side apply (``application/apply-patch+yaml``, field manager ``shoal-operator``,
``force=true``): the API server records which fields the operator set, so a field the operator stops rendering
(a removed nodeSelector, the download init container after hf:// -> pvc://) is removed from the child, while
fields other controllers own (a Service's clusterIP, an HPA's replicas elsewhere) are left alone. Applying an
object that does not exist creates it. The InferenceService's status is written with a JSON merge patch.
No PUT, no strategic merge.

``PERMISSIONS`` below is the exact list the operator needs; the Helm chart's ClusterRole (and its namespaced
Role variant) must grant exactly these.
"""

from __future__ import annotations

import logging
from typing import Any

from shoal.operator import api
from shoal.operator.k8s.client import ApiError, Client, collection_path, load_configuration, object_path
from shoal.operator.k8s.events import post_event

__all__ = ["ApiError", "Kube", "load_configuration", "path", "PERMISSIONS", "KINDS"]

logger = logging.getLogger(__name__)

# (apiGroup, resource, verbs) — least privilege for shoal-operator, including what kopf itself does. Children are
# read from watch streams only (kopf's indexes), so no `get` on them.
_CHILD_VERBS = ("list", "watch", "create", "patch", "delete")  # an apply that creates is authorized as create
PERMISSIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # the custom resource: watched by kopf, read once before creating children (never resurrect a deleted one);
    # kopf patches annotations (progress/diff-base) on the object
    (api.GROUP, "inferenceservices", ("get", "list", "watch", "patch")),
    (api.GROUP, "inferenceservices/status", ("patch",)),  # also the autoscaler's replica count
    # children get ownerReferences with blockOwnerDeletion=true (OwnerReferencesPermissionEnforcement)
    (api.GROUP, "inferenceservices/finalizers", ("update",)),
    # children: reconciled (server-side apply; prune) and watched (indexes, drift, status)
    ("apps", "deployments", _CHILD_VERBS),
    ("apps", "statefulsets", _CHILD_VERBS),
    ("", "services", _CHILD_VERBS),
    ("", "configmaps", _CHILD_VERBS),
    ("", "persistentvolumeclaims", _CHILD_VERBS),  # the shared model cache claim (model.cache.persistent)
    ("networking.k8s.io", "networkpolicies", _CHILD_VERBS),
    ("policy", "poddisruptionbudgets", _CHILD_VERBS),
    # pods: watched for status reasons; deleted to restart a multi-pod group as a whole; annotated with a
    # deletion cost by the autoscaler so that a scale-down removes the least busy ones
    ("", "pods", ("list", "watch", "patch", "delete")),
    # the gateway's identity (per InferenceService): its ServiceAccount, and a Role + RoleBinding
    ("", "serviceaccounts", _CHILD_VERBS),
    ("rbac.authorization.k8s.io", "roles", _CHILD_VERBS),
    ("rbac.authorization.k8s.io", "rolebindings", _CHILD_VERBS),
    # the autoscaler watches the engine and gateway endpoints it scrapes (their Services' EndpointSlices, which
    # carry the Services' labels); RBAC lets the operator grant only what it holds itself, so this also covers the
    # gateway's Role (list, watch)
    ("discovery.k8s.io", "endpointslices", ("list", "watch")),
    # Events: posted by kopf.event() for transitions; listed (FailedCreate of a StatefulSet, which has no
    # condition for it) only while a group misses pods
    ("", "events", ("list", "create", "patch")),
    # spec.inferencePool: an InferencePool and an HTTPRoute for a Gateway running the inference extension
    ("inference.networking.k8s.io", "inferencepools", _CHILD_VERBS),
    ("gateway.networking.k8s.io", "httproutes", _CHILD_VERBS),
    # kopf: resource discovery follows CRDs as they appear (cluster-wide operators)
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
)
# kopf peering (several operator replicas, the chart's highAvailability): a ClusterKopfPeering for a cluster-wide
# operator, a KopfPeering in each watched namespace for a namespaced one.
CLUSTER_PEERING_PERMISSIONS = ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"))
NAMESPACED_PEERING_PERMISSIONS = ("kopf.dev", "kopfpeerings", ("list", "watch", "patch"))
# kopf lists and watches namespaces only to resolve -n names in a cluster-wide deployment; with -A it never does.
NAMESPACE_PERMISSIONS = ("", "namespaces", ("list", "watch"))
# A namespaced deployment (`shoal-operator -n NS`) needs everything above except the cluster-scoped rows in a
# Role; the CRD itself is installed by the chart.
CLUSTER_SCOPED = frozenset({"customresourcedefinitions", "namespaces"})

# kind -> (apiVersion, plural); everything the operator creates, patches or deletes
KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("apps/v1", "deployments"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "Service": ("v1", "services"),
    "ConfigMap": ("v1", "configmaps"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Pod": ("v1", "pods"),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices"),
    "Event": ("v1", "events"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
    api.KIND: (api.API_VERSION, api.PLURAL),
}
# Kinds of CRDs a cluster may not have (the Gateway API and its inference extension): kopf watches them once they
# exist; applying one before is refused with a message saying which CRDs to install.
OPTIONAL_KINDS = ("InferencePool", "HTTPRoute")
CHILD_KINDS = ("ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet", "Deployment", "NetworkPolicy",
               "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding", *OPTIONAL_KINDS)
# what the operator watches besides InferenceServices: its children, and the pods of its workloads
WATCHED_KINDS = (*CHILD_KINDS, "Pod")


FIELD_MANAGER = "shoal-operator"


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    api_version, plural = KINDS[kind]
    if name:
        return object_path(api_version, plural, namespace, name, subresource)
    return collection_path(api_version, plural, namespace)


class Kube:
    """The operator's calls by kind (KINDS), on the fleet half's one client (k8s.client.Client: aiohttp)."""

    def __init__(self, client: Client):
        self.client = client

    @classmethod
    def from_environment(cls) -> "Kube":
        """In-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config (resolved on the
        first call, in the running loop)."""
        return cls(Client())

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return await self.client.get(path(kind, namespace, name))

    async def list(self, kind: str, namespace: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        return await self.client.list(path(kind, namespace), label_selector, field_selector)

    async def create(self, kind: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST: 409 when the name is taken."""
        return await self.client.create(path(kind, namespace), obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of a complete desired object (creates it when missing): afterwards the object holds
        exactly these fields of ours, fields we applied before and no longer do are removed."""
        meta = obj["metadata"]
        return await self.client.apply(path(obj["kind"], meta["namespace"], meta["name"]), obj, FIELD_MANAGER)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        return await self.client.merge_patch(path(kind, namespace, name, subresource), patch)

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None,
                     propagation: str = "Background") -> None:
        await self.client.delete(path(kind, namespace, name), uid=uid, propagation=propagation)

    async def event(self, isvc: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A Kubernetes Event on the InferenceService (best effort: k8s.events)."""
        m = isvc["metadata"]
        involved = {"apiVersion": api.API_VERSION, "kind": api.KIND,
                    "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m.get("uid")}}
        await post_event(self.client, involved, type_, reason, message)

    async def close(self) -> None:
        await self.client.close()
