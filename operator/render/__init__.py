"""Pure rendering: (InferenceService, operator Settings) -> the desired child manifests. No I/O here.

Topology
--------
One replica is a *group* of ``pods_per_replica = ceil(tp*pp / gpusPerPod)`` pods (1 on CPU, gpusPerPod 0).

* single-pod replicas: one Deployment ``<name>`` with ``spec.replicas`` pods;
* multi-pod replicas: per replica one StatefulSet ``<name>-g<index>`` (Parallel pod management, OnDelete
  updates: the operator rolls whole groups, see rollout.py) and its headless Service ``<name>-g<index>``
  (publishNotReadyAddresses, so ranks resolve each other before they are ready). The rank is the pod ordinal,
  read through the downward API from the label ``apps.kubernetes.io/pod-index`` (set by the StatefulSet
  controller, Kubernetes >= 1.28) into ``SHOAL_NODE_RANK``; rank 0 is ``<name>-g<r>-0.<name>-g<r>.<ns>.svc.<domain>``. Ranks other than 0 add
  ``--headless`` (a two-line ``sh`` wrapper, since a StatefulSet has one pod template for all ordinals);
* a PersistentVolumeClaim ``<name>-model-cache`` for a persistent shared model cache (model.cache);
* a PersistentVolumeClaim ``<name>-gateway-batches`` for the gateway's batches (gateway.batches; kept when batches
  are turned off, deleted with the InferenceService);
* with ``engine.enableLora``: the ConfigMap ``<name>-adapters`` (spec.adapters, read by the pods' adapter-sync
  sidecar: adapters.py);
* with ``spec.prefill`` (prefill/decode disaggregation): the Deployment ``<name>-prefill`` of prefill engines
  (component=prefill, started as KV producers; the other engines as consumers), the headless Service
  ``<name>-prefill`` the gateway discovers them through (``--prefill-service``), their NetworkPolicy (the gateway
  and the decode engines reach them) and, past one replica, their PodDisruptionBudget;
* always: the Service ``<name>`` (port 8000), a NetworkPolicy ``<name>`` for the engines (unless disabled), a
  PodDisruptionBudget ``<name>`` when replicas > 1, a ConfigMap ``<name>-chat-template`` when the spec carries a
  chat template;
* with ``spec.gateway.enabled`` (the default): ``<name>`` selects the shoal-gateway pods of the Deployment
  ``<name>-gateway``, which discovers the rank-0 engine pods through the EndpointSlices of the headless Service
  ``<name>-engines`` (ServiceAccount, Role and RoleBinding ``<name>-gateway``: list/watch EndpointSlices, nothing
  else), with its own PodDisruptionBudget and NetworkPolicy ``<name>-gateway``; the engines then accept HTTP only
  from the gateway pods (and the operator's namespace, for metrics). Disabled: ``<name>`` selects the rank-0
  engine pods directly.

Every child carries an ownerReference (controller) to the InferenceService, the label scheme below, and the
annotation ``serving.shoal.dev/spec-hash`` (hash of the rendered object) that the reconciler compares.

Layout
------
One module per child kind or concern, this package's ``__init__`` tying them together (``plan``, ``render``):
common (Settings, labels, metadata), containers (what engine and gateway pods share), configmaps, model_cache,
engine_pod, shared_gateway, network (Services, NetworkPolicy, PDB), gateway and inference_extension. Each module
imports only the ones before it in that list; the names other modules use are re-exported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shoal.operator import api, canary
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec
# names, labels and annotations: the InferenceService contract (contract.py), which the gateway reads by too
from shoal.operator.contract import (A_GROUP_SIZE, A_REVISION, A_SPEC_HASH, L_CANARY, L_CANARY_PERCENT, L_COMPONENT,
                                     L_GROUP, L_INSTANCE, L_ISVC, L_MANAGED_BY, L_NAME, L_PART_OF, L_POD_INDEX,
                                     MANAGED_BY, MODELS_DIR, canary_name, engines_service_name, gateway_name,
                                     prefill_name, wake_configmap_name)
from shoal.operator.render.common import (DEFAULT_ENGINE_IMAGE, DEFAULT_FLEET_IMAGE, DEFAULT_GATEWAY_IMAGE, PODTOOLS,
                                          Settings, gateway_selector, group_name, labels, pod_selector, spec_hash)
from shoal.operator.render.containers import (API_KEYS_DIR, API_KEYS_FILE, API_KEYS_MOUNT, A_ISTIO_EXCLUDE_INBOUND,
                                              A_ISTIO_EXCLUDE_OUTBOUND, A_ISTIO_INCLUDE_INBOUND, KV_EVENTS_PORT,
                                              KV_REPLAY_PORT, api_key_volume, kv_events_config, kv_events_ports,
                                              kv_events_topic, mesh_annotations, precise_prefix, traces_url,
                                              tracing_env)
from shoal.operator.render.configmaps import (CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_KEY, adapters_configmap,
                                              chat_template_configmap, scales_from_zero, wake_configmap)
from shoal.operator.render.model_cache import (ADAPTER_CACHE_BOUND, ADAPTER_CACHE_SHARE, CACHE_DIR,
                                               DOWNLOAD_BOUND_CPU_DEFAULT, DOWNLOAD_BOUND_PER_GPU, DOWNLOAD_CONTAINER,
                                               LEASE_CONTAINER, MODEL_CACHE_DIR, QUANTIZE_ON_LOAD_RATIO, _per_pod_cache,
                                               adapter_cache_cap, cache_bound, cache_cap, cache_claim, cache_claim_name,
                                               cache_location, cache_volume, default_download_bound, model_path)
from shoal.operator.render.engine_pod import (CPU_ONLY_ENV, ENGINE_CACHE_DIR, ENGINE_CACHE_SUBPATH, KUEUE_QUEUE_LABEL,
                                              canary_deployment, cpu_engine_cpus, deployment, engine_args,
                                              group_revision, kv_transfer_config, pod_template, prefill_deployment,
                                              statefulset)
from shoal.operator.render.shared_gateway import SHARED_GATEWAY_COMPONENT, shared_gateway_access, shared_gateway_peers
from shoal.operator.render.network import (GATEWAY_METRICS_PORT, disruption_budget, engines_service,
                                           gateway_metrics_service_port, gateway_service, headless_service,
                                           network_policy, prefill_disruption_budget, prefill_network_policy,
                                           prefill_service, serving_selector)
from shoal.operator.render.gateway import (GATEWAY_BASE_BYTES, GATEWAY_BATCH_BYTES, GATEWAY_BATCH_DIR,
                                           GATEWAY_INDEX_BYTES, GATEWAY_PER_REQUEST_BYTES, GATEWAY_UID,
                                           batches_claim_name, gateway_batches_claim, gateway_batches_volume,
                                           gateway_children, gateway_deployment, gateway_disruption_budget,
                                           gateway_limit_args, gateway_memory, gateway_metrics_listener,
                                           gateway_network_policy, gateway_rbac)
from shoal.operator.render.inference_extension import (HTTP_ROUTE_API, INFERENCE_POOL_API, MODEL_NAME_HEADER,
                                                       ROUTE_MATCHES, ROUTE_MATCHES_PER_RULE, http_routes,
                                                       inference_extension_children, inference_pool, route_name,
                                                       served_names)


@dataclass(frozen=True)
class Plan:
    """What a reconcile needs besides the manifests: derived topology and status fields."""

    name: str
    namespace: str
    spec: InferenceServiceSpec
    pods_per_replica: int
    gpus_per_pod: int
    served_model_name: str
    url: str
    selector: dict[str, str]
    children: list[dict[str, Any]] = field(default_factory=list)  # all but the groups of a multi-pod replica
    revision: str = ""  # of the groups' template (multi-pod)
    canary: InferenceServiceSpec | None = None  # the canary revision's whole spec (spec.canary)
    canary_revision: str = ""
    canary_percent: int = 0  # the share the gateways apply (0 once rolled back)
    isvc: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    settings: Settings = field(default_factory=Settings, repr=False, compare=False)

    def group(self, index: int) -> list[dict[str, Any]]:
        """The children of group `index` of a multi-pod replica: its headless Service and StatefulSet."""
        return [headless_service(self.isvc, self.spec, index),
                statefulset(self.isvc, self.spec, self.settings, index, self.revision)]

    @property
    def multi_pod(self) -> bool:
        return self.pods_per_replica > 1

    @property
    def selector_str(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


def plan(isvc: dict[str, Any], settings: Settings = Settings()) -> Plan:
    """Validate the spec (raises api.SpecError naming the field) and render every desired child."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = api.validate(name, isvc.get("spec") or {}, max_gpus_per_node=settings.max_gpus_per_node)
    pinned = (isvc.get("status") or {}).get("engineImage")
    if pinned and pinned != settings.engine_image:  # the default image this service runs (upgrade.py)
        settings = dataclasses.replace(settings, engine_image=pinned)
    running = api.running_replicas(spec, isvc.get("status"))
    if running != spec.replicas:  # autoscaled: the children follow the autoscaler, never spec.replicas
        spec = spec.model_copy(update={"replicas": running})
    if spec.prefill is not None and (prefill := api.running_prefill_replicas(spec, isvc.get("status"))) != \
            spec.prefill.replicas:  # the prefill role autoscaled on its own signal (spec.prefill.autoscaling)
        spec = spec.model_copy(update={"prefill": spec.prefill.model_copy(update={"replicas": prefill})})
    pods = spec.pods_per_replica(settings.max_gpus_per_node)
    multi = pods > 1
    children: list[dict[str, Any]] = []
    if spec.model.chat_template:
        children.append(chat_template_configmap(isvc, spec))
    if spec.engine.enable_lora:
        children.append(adapters_configmap(isvc, spec))
    if spec.model.cache.persistent and not _per_pod_cache(spec):
        children.append(cache_claim(isvc, spec))
    if not multi:  # the groups of multi-pod replicas are chosen by the rollout (Plan.group, rollout.py)
        children.append(deployment(isvc, spec, settings))
    canary_spec = api.canary_spec(spec) if spec.canary is not None else None
    canary_percent = canary.traffic_percent(spec, isvc.get("status")) if canary_spec is not None else None
    if canary_spec is not None and not canary.rolled_back(spec, isvc.get("status")):
        children.append(canary_deployment(isvc, canary_spec, settings))
    children.append(gateway_service(isvc, spec, multi, settings))
    if spec.security.network_policy.enabled:
        children.append(network_policy(isvc, spec, settings, multi))
    if spec.replicas > 1:
        children.append(disruption_budget(isvc, spec))
    if spec.prefill is not None:  # prefill/decode disaggregation: the prefill role and how it is reached
        children += [prefill_deployment(isvc, spec, settings), prefill_service(isvc, spec)]
        if spec.security.network_policy.enabled:
            children.append(prefill_network_policy(isvc, spec, settings))
        if spec.prefill.replicas > 1:
            children.append(prefill_disruption_budget(isvc, spec))
    if spec.gateway.enabled:
        children += gateway_children(isvc, spec, settings, multi, canary_percent)
        children += shared_gateway_access(isvc, spec, settings)
    if spec.inference_pool is not None:
        children += inference_extension_children(isvc, spec, multi)
    selector = pod_selector(name) if not multi else {**pod_selector(name), L_POD_INDEX: "0"}
    return Plan(
        name=name, namespace=namespace, spec=spec, pods_per_replica=pods,
        gpus_per_pod=spec.gpus_per_pod(settings.max_gpus_per_node),
        served_model_name=api.served_model_name(name, spec),
        url=f"http://{name}.{namespace}.svc.{settings.cluster_domain}:{ENGINE_PORT}",
        selector=selector, children=children,
        revision=group_revision(isvc, spec, settings) if multi else "", isvc=isvc, settings=settings,
        canary=canary_spec, canary_revision=canary.revision(spec) if canary_spec is not None else "",
        canary_percent=canary_percent or 0,
    )


def render(isvc: dict[str, Any], settings: Settings = Settings()) -> list[dict[str, Any]]:
    """The desired children of an InferenceService once rolled out: groups 0..replicas-1 for multi-pod replicas
    (raises api.SpecError for an invalid spec)."""
    p = plan(isvc, settings)
    groups = [obj for r in range(p.spec.replicas) for obj in p.group(r)] if p.multi_pod else []
    return groups + p.children
