"""The few Kubernetes API calls the handlers make, in one place.

Verbs used: get, list, watch (kopf's watch streams and indexes, the autoscaler's informers), create (Events),
patch and delete.

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

import asyncio
import concurrent.futures
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from shoal.operator import api

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


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str = ""):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    api_version, plural = KINDS[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        p += f"/{name}"
        if subresource:
            p += f"/{subresource}"
    return p


def load_configuration() -> Any:
    """A fresh `kubernetes.client.Configuration`: the in-cluster service account when running in a pod, else
    the kubeconfig named by $KUBECONFIG *now* (the client library fixes its default path at import time)."""
    import kubernetes

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        config_file = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        kubernetes.config.load_kube_config(config_file=config_file, client_configuration=configuration)
    return configuration


@dataclass
class Kube:
    """A thin JSON client over the official `kubernetes` package (kubeconfig / in-cluster auth, TLS, exec
    plugins and token refresh all come from it); blocking calls run in a small thread pool."""

    api_client: Any
    executor: concurrent.futures.ThreadPoolExecutor

    @classmethod
    def from_environment(cls, workers: int = 16) -> "Kube":
        """In-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config."""
        import kubernetes

        configuration = load_configuration()
        configuration.connection_pool_maxsize = workers
        configuration.retries = False
        return cls(kubernetes.client.ApiClient(configuration),
                   concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="shoal-kube"))

    def _call(self, method: str, url: str, body: Any = None, query: list | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        import kubernetes

        c = self.api_client
        try:
            _method, full_url, headers, data, post = c.param_serialize(
                method=method, resource_path=url, query_params=query or [], body=body,
                header_params={"Accept": "application/json", "Content-Type": content_type},
                auth_settings=["BearerToken"])
            resp = c.call_api(_method, full_url, header_params=headers, body=data, post_params=post,
                              _request_timeout=(10, 60))
            resp.read()
        except kubernetes.client.ApiException as e:
            raise ApiError(e.status or 0, e.reason or "", str(e.body or "")) from None
        raw = resp.data or b""
        if not 200 <= resp.status < 300:
            try:
                status = json.loads(raw or b"{}")
            except ValueError:
                status = {}
            raise ApiError(resp.status, status.get("reason") or resp.reason or "", status.get("message", ""))
        return json.loads(raw) if raw else {}

    async def _run(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: self._call(*args, **kwargs))

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return await self._run("GET", path(kind, namespace, name))

    async def list(self, kind: str, namespace: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        query += [("fieldSelector", field_selector)] if field_selector else []
        return (await self._run("GET", path(kind, namespace), query=query)).get("items", [])

    async def create(self, kind: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST: 409 when the name is taken (the autoscaler's Events use generateName)."""
        return await self._run("POST", path(kind, namespace), body=obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of a complete desired object (creates it when missing): afterwards the object holds
        exactly these fields of ours, fields we applied before and no longer do are removed."""
        meta = obj["metadata"]
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        return await self._run("PATCH", path(obj["kind"], meta["namespace"], meta["name"]), body=obj, query=query,
                               content_type="application/apply-patch+yaml")

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        return await self._run("PATCH", path(kind, namespace, name, subresource), body=patch,
                               content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None,
                     propagation: str = "Background") -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if uid:  # never delete a same-named successor of the object we decided about
            body["preconditions"] = {"uid": uid}
        await self._run("DELETE", path(kind, namespace, name), body=body)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        try:
            self.api_client.close()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
