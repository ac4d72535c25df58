"""The engines: their args, env, resources and mounts, the engine container and the adapter-sync sidecar,
the pod template (with spec.podOverlay applied), and the workloads around it: the Deployment of single-pod
replicas, the canary's Deployment and the StatefulSets of multi-pod groups. Separate because this is the one place
that knows how an engine runs in a pod.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from shoal.operator import adapters, api, overlay, runtimes, upgrade
from shoal.operator.api import ENGINE_PORT, InferenceServiceSpec, MASTER_PORT
from shoal.operator.contract import (A_GROUP_SIZE, A_REVISION, A_SPEC_HASH, L_CANARY, L_GROUP, L_POD_INDEX, MODELS_DIR,
                                     canary_name, prefill_name)
from shoal.operator.render.common import (PODTOOLS, Settings, _finish, _meta, group_name, labels, pod_selector,
                                          prefill_selector)
from shoal.operator.render.containers import (API_KEYS_FILE, API_KEYS_MOUNT, _key_file, _restricted_container,
                                              api_key_volume, kv_events_config, kv_events_ports, mesh_annotations,
                                              publishes_kv_events, traces_url, tracing_env)
from shoal.operator.render.configmaps import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_KEY
from shoal.operator.render.model_cache import (CACHE_DIR, _cache_claimed, _claim_spec, _download_container,
                                               _lease_container, _per_pod_cache, _shared_cache, adapter_cache_cap,
                                               cache_volume, model_path)


# The engine mounts /cache read-only (the model cache other pods share, the adapters the sidecar fetched); what it
# writes itself — JIT-built kernels, a runtime's compile caches, the demo model — goes to this writable subPath of
# the same volume, so on a claim it outlives the pod like the models do.
ENGINE_CACHE_DIR = "/engine-cache"
ENGINE_CACHE_SUBPATH = "shoal/engine"


def kv_transfer_config(role: str) -> str:
    """--kv-transfer-config of a disaggregated service's engines (spec.prefill): the prefill role produces KV,
    the decode engines consume it."""
    return json.dumps({"kv_connector": "ShoalConnector", "kv_role": "kv_producer" if role == "prefill" else
                       "kv_consumer"}, separators=(",", ":"))


def engine_args(name: str, namespace: str, spec: InferenceServiceSpec, settings: Settings, *,
                replica: int | None = None, role: str = "engine") -> list[str]:
    """Arguments of the runtime's server (after its command): spec.engine through the runtime's table. `role`:
    "engine" (the serving or decode engines) or "prefill" (spec.prefill's)."""
    group = None
    pods = spec.pods_per_replica(settings.max_gpus_per_node)
    if pods > 1:
        assert replica is not None
        g = group_name(name, replica)
        group = runtimes.Group(nnodes=pods, master_addr=f"{g}-0.{g}.{namespace}.svc.{settings.cluster_domain}",
                               master_port=MASTER_PORT)
    template = f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_KEY}" if spec.model.chat_template else None
    rt = runtimes.of(spec)
    args = runtimes.args(rt, spec, model=model_path(spec), served_name=api.served_model_name(name, spec),
                         port=ENGINE_PORT, chat_template=template, group=group)
    if _key_file(spec):  # before spec.engine.extraArgs, which come last
        at = len(args) - len(spec.engine.extra_args)
        args[at:at] = ["--api-key-file", API_KEYS_FILE]
    if spec.tracing is not None and rt.tracing_flag:  # before spec.engine.extraArgs too
        at = len(args) - len(spec.engine.extra_args)
        args[at:at] = [rt.tracing_flag, traces_url(spec.tracing)]
    if publishes_kv_events(spec, settings):  # vLLM's flag, the same JSON for both runtimes; before extraArgs
        at = len(args) - len(spec.engine.extra_args)
        args[at:at] = ["--kv-events-config", kv_events_config(name, namespace)]
    if spec.prefill is not None:  # vLLM's flag; before extraArgs
        at = len(args) - len(spec.engine.extra_args)
        args[at:at] = ["--kv-transfer-config", kv_transfer_config(role)]
    if rt.name == "shoal" and spec.gpus_per_pod(settings.max_gpus_per_node) == 0:
        args += ["--device", "cpu"]  # never `auto`: a GPU the node's runtime leaks in must not be picked
    return args


# A CPU pod sees no GPU even on a GPU node whose default container runtime is nvidia: the CUDA base image sets
# NVIDIA_VISIBLE_DEVICES=all, which that runtime honours for any container; `void` makes it expose neither devices
# nor driver libraries, and CUDA_VISIBLE_DEVICES=-1 (an invalid index: CUDA lists no device from there on) hides any
# device that is mounted all the same. Not an empty value: the API server drops empty env values (omitempty), so the
# stored template would never equal the rendered one and every reconcile would re-apply it.
CPU_ONLY_ENV = ({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, {"name": "CUDA_VISIBLE_DEVICES", "value": "-1"})


def _stored_env(var: dict[str, Any]) -> dict[str, Any]:
    """An env var as the API server stores it: `value: ""` is dropped (omitempty; the variable is still set, empty).
    Rendering it that way keeps the drift check from firing on every pass."""
    return {k: v for k, v in var.items() if not (k == "value" and v == "")}


def cpu_engine_cpus(spec: InferenceServiceSpec, gpus: int) -> int | None:
    """Whole CPUs for a CPU-only Shoal engine with a CPU request: the request rounded up, rendered as request ==
    limit. Whole CPUs, because a CFS quota with a fraction (1500m) lets a step's threads run out of quota mid-step
    and stop for the rest of the period, and because only a Guaranteed pod's integer CPUs get exclusive cores from
    the static CPU manager policy; the engine runs one OpenMP thread per CPU (docs/performance.md)."""
    if gpus > 0 or spec.resources.cpu is None or spec.runtime != "shoal":
        return None
    from kubernetes.utils import parse_quantity

    return max(1, math.ceil(parse_quantity(str(spec.resources.cpu))))


def _engine_env(spec: InferenceServiceSpec, multi: bool, gpus: int) -> list[dict[str, Any]]:
    """The env every container of the pod shares: cache locations, the rank (multi-pod), GPU visibility (CPU
    pods), then the user's env."""
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "SHOAL_CACHE", "value": f"{CACHE_DIR}/shoal"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},  # hf:// models are fetched by the init container first
        *({"name": k, "value": v} for k, v in runtimes.of(spec).env),
        *({"name": k, "value": v} for k, v in (runtimes.of(spec).lora_env if spec.engine.enable_lora else ())),
    ]
    if multi:
        env.append({"name": "SHOAL_NODE_RANK",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{L_POD_INDEX}']"}}})
    if gpus == 0:
        env += [dict(e) for e in CPU_ONLY_ENV]
    cpus = cpu_engine_cpus(spec, gpus)
    if cpus is not None:  # the engine would read the quota itself; said outright where a cgroup is unreadable
        env.append({"name": "OMP_NUM_THREADS", "value": str(cpus)})
    user_names = {e.get("name") for e in spec.env}
    return [e for e in env if e["name"] not in user_names] + [_stored_env(copy.deepcopy(e)) for e in spec.env]


def _with_api_key(env: list[dict[str, Any]], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The API key reaches the engine only as an env var from the Secret, which the engine reads itself
    (SHOAL_API_KEY, VLLM_API_KEY: the runtime's): never in args (the kubelet would expand it into /proc/*/cmdline
    and the runtime's config) nor in init containers."""
    ref = spec.security.api_key_secret_ref
    if not ref:
        return list(env)
    key_env = runtimes.of(spec).api_key_env
    assert key_env is not None, "refused by runtimes.spec_errors"
    return [e for e in env if e["name"] != key_env] + [
        {"name": key_env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _engine_resources(spec: InferenceServiceSpec, gpus: int) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    cpus = cpu_engine_cpus(spec, gpus)
    if cpus is not None:
        requests["cpu"] = limits["cpu"] = str(cpus)
    elif spec.resources.cpu is not None:
        requests["cpu"] = str(spec.resources.cpu)
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = str(spec.resources.memory)
    if gpus > 0:
        requests[spec.resources.gpu_resource] = limits[spec.resources.gpu_resource] = str(gpus)
    for resource, quantity in spec.resources.extra.items():
        requests[resource] = limits[resource] = str(quantity)
    size = spec.cache_size()
    if size is not None and not _cache_claimed(spec):  # the emptyDir lives on the node's ephemeral storage
        requests["ephemeral-storage"] = str(size)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _engine_writable_env(env: list[dict[str, Any]], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The engine's own caches on its writable mount (its /cache is read-only), unless spec.env names them: the
    JIT-built CPU kernels (native_build keys them by CPU tier and serialises builders), XDG caches, $SHOAL_CACHE."""
    user = {e.get("name") for e in spec.env}
    own = {k: v for k, v in (("XDG_CACHE_HOME", ENGINE_CACHE_DIR), ("SHOAL_CACHE", f"{ENGINE_CACHE_DIR}/shoal"),
                             ("TORCH_EXTENSIONS_DIR", f"{ENGINE_CACHE_DIR}/torch_extensions")) if k not in user}
    ours = len(env) - len(spec.env)  # _engine_env: the operator's entries, then the user's
    head = [{"name": e["name"], "value": own.pop(e["name"])} if e["name"] in own else e for e in env[:ours]]
    return head + [{"name": k, "value": v} for k, v in own.items()] + env[ours:]


def _engine_mounts(mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine's volumeMounts: /cache read-only (a write there would reach every pod sharing the cache), its
    writable subPath at ENGINE_CACHE_DIR. The init containers and sidecars keep the read-write /cache."""
    out = []
    for m in mounts:
        if m["name"] == "cache" and m["mountPath"] == CACHE_DIR:
            out += [{**m, "readOnly": True},
                    {"name": "cache", "mountPath": ENGINE_CACHE_DIR, "subPath": ENGINE_CACHE_SUBPATH}]
        else:
            out.append(m)
    return out


def _volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the pod's volumeMounts): /dev/shm, the model cache, /tmp, a pvc:// model, the chat template (the
    engine's own view of them: _engine_mounts)."""
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.resources.shm_size)}},
        *cache_volume(name, spec),
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.model.uri.startswith("pvc://"):
        claim = spec.model.uri[len("pvc://"):].split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    if spec.model.uri.startswith("oci://"):  # an image volume (Kubernetes >= 1.31, ImageVolume): pulled, not fetched
        volumes.append({"name": "model", "image": {"reference": spec.model.uri[len("oci://"):],
                                                   "pullPolicy": spec.image_pull_policy or "IfNotPresent"}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    if spec.model.chat_template:
        volumes.append({"name": "chat-template", "configMap": {"name": f"{name}-chat-template"}})
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})
    for i, claim in enumerate(adapters.claims(spec)):  # pvc:// adapters: their claims, read-only
        volumes.append({"name": f"adapter-claim-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"adapter-claim-{i}", "mountPath": f"{adapters.CLAIMS_DIR}/{claim}", "readOnly": True})
    if spec.engine.enable_lora:  # the adapter list, by name only: its content is not part of the template
        volumes.append({"name": "adapters", "configMap": {"name": adapters.configmap_name(name)}})
    if _key_file(spec):  # mounted by the engine container alone (never the init containers)
        volumes += api_key_volume(spec)
    return volumes, mounts


def _failure_grace(probes: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """A container killed for failing its liveness or startup probe gets a short grace period of its own: the
    pod's is sized for draining long requests on a scale-down (engine.shutdownTimeoutSeconds)."""
    grace = spec.probes.failure_grace_period_seconds
    return {kind: {**probe, "terminationGracePeriodSeconds": grace} if kind in ("livenessProbe", "startupProbe")
            else probe for kind, probe in probes.items()}


def _engine_container(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings, *,
                      replica: int | None, multi: bool, env: list[dict[str, Any]],
                      mounts: list[dict[str, Any]], role: str = "engine") -> dict[str, Any]:
    name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
    rt = runtimes.of(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image or rt.image or settings.engine_image,
        **runtimes.argv(rt, multi, engine_args(name, namespace, spec, settings, replica=replica, role=role)),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
                 + ([{"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"}] if multi else [])
                 + kv_events_ports(spec, settings),
        # spec.env (in `env`) wins over the OTEL_* variables spec.tracing renders
        "env": [e for e in tracing_env(isvc, spec) if e["name"] not in {u.get("name") for u in spec.env}]
               + (_engine_writable_env(env, spec) if _key_file(spec)
                  else _with_api_key(_engine_writable_env(env, spec), spec)),
        "resources": _engine_resources(spec, spec.gpus_per_pod(settings.max_gpus_per_node)),
        "volumeMounts": _engine_mounts(mounts) + ([API_KEYS_MOUNT] if _key_file(spec) else []),
        **_failure_grace(runtimes.probes(rt, spec, multi, ENGINE_PORT), spec),
        "lifecycle": {"preStop": {"sleep": {"seconds": settings.prestop_seconds}}},
        "securityContext": _restricted_container(spec.security.capabilities),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _adapter_sync_container(spec: InferenceServiceSpec, image: str, env: list[dict[str, Any]],
                            mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The sidecar that keeps the engine's adapters equal to spec.adapters (adapters.py): it fetches hf://
    adapters (so it may reach the hub, like the download init container) and calls the engine on localhost with
    the engine's API key."""
    ref = spec.security.api_key_secret_ref
    # Shoal's engine: the mounted key Secret, whose first line it reads at each call (a rotation needs no restart)
    key = [{"name": "SHOAL_API_KEY_FILE", "value": API_KEYS_FILE}] if _key_file(spec) else \
        [{"name": "SHOAL_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}] if ref else []
    container = {
        "name": adapters.SIDECAR,
        "image": image,
        "command": [PODTOOLS],
        "args": ["sync-adapters", "--config", f"{adapters.CONFIG_DIR}/{adapters.CONFIG_KEY}",
                 "--engine-url", f"http://127.0.0.1:{ENGINE_PORT}", "--port", str(adapters.SIDECAR_PORT)]
                # a cache other pods (or other services) share: their lists may still use a snapshot this pod's
                # list dropped, so only a pod's own cache is collected
                + (["--keep-unused-snapshots"] if _shared_cache(spec) else [])
                + (["--max-cache-bytes", str(cap)] if (cap := adapter_cache_cap(spec)) else []),
        "ports": [{"name": adapters.SIDECAR, "containerPort": adapters.SIDECAR_PORT, "protocol": "TCP"}],
        "env": [e for e in env if e["name"] not in ("HF_HUB_OFFLINE", "SHOAL_API_KEY")] + key,
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")]
                        + [{"name": "adapters", "mountPath": adapters.CONFIG_DIR, "readOnly": True}]
                        + ([API_KEYS_MOUNT] if _key_file(spec) else []),
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # Ready once the pod's first adapter list is loaded (or failed): new pods turn Ready with the adapters
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": adapters.SIDECAR}, "periodSeconds": 2,
                           "failureThreshold": 1, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": adapters.SIDECAR}, "periodSeconds": 30,
                          "failureThreshold": 3, "timeoutSeconds": 5},
        "securityContext": _restricted_container(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _placement(spec: InferenceServiceSpec) -> dict[str, Any]:
    """Where the pod may run and as whom: spec.scheduling, the service account, image pull secrets."""
    sched = spec.scheduling
    fields: dict[str, Any] = {
        "nodeSelector": dict(sched.node_selector),
        "tolerations": copy.deepcopy(sched.tolerations),
        "affinity": copy.deepcopy(sched.affinity),
        "priorityClassName": sched.priority_class_name,
        "topologySpreadConstraints": copy.deepcopy(sched.topology_spread_constraints),
        "schedulerName": sched.scheduler_name,
        "runtimeClassName": sched.runtime_class_name,
        "serviceAccountName": spec.pod.service_account_name,
        "imagePullSecrets": [{"name": n} for n in spec.image_pull_secrets],
    }
    return {k: v for k, v in fields.items() if v}  # unset (None, empty) fields stay out of the manifest


def pod_template(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings, *,
                 replica: int | None = None, role: str = "engine") -> dict[str, Any]:
    """The engine pod: its container, volumes and probes, placement, then the user's overlay (spec.pod.template).
    `role` "prefill": a prefill engine of spec.prefill (its pods labelled component=prefill)."""
    name = isvc["metadata"]["name"]
    multi = spec.pods_per_replica(settings.max_gpus_per_node) > 1
    pod_labels = labels(name, role)
    if multi:
        pod_labels[L_GROUP] = str(replica)

    env = _engine_env(spec, multi, spec.gpus_per_pod(settings.max_gpus_per_node))
    volumes, mounts = _volumes(name, spec)
    container = _engine_container(isvc, spec, settings, replica=replica, multi=multi, env=env, mounts=mounts,
                                  role=role)
    init_containers = ([_download_container(spec, settings.fleet_image, env, mounts)]
                       if spec.model.uri.startswith("hf://") else [])
    if init_containers and _shared_cache(spec):
        init_containers.append(_lease_container(spec, settings.fleet_image, env, mounts))
    sidecars = [_adapter_sync_container(spec, settings.fleet_image, env, mounts)] if spec.engine.enable_lora else []
    pod_spec: dict[str, Any] = {
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container, *sidecars],
        "volumes": volumes,
        "automountServiceAccountToken": spec.pod.automount_service_account_token,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.shutdown_timeout_seconds + settings.prestop_seconds + 15,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **_placement(spec),
    }
    metadata: dict[str, Any] = {"labels": {**spec.pod.labels, **pod_labels}}
    annotations = {**(mesh_annotations() if multi else {}), **spec.pod.annotations}  # the user's win
    if annotations:
        metadata["annotations"] = annotations
    return _apply_overlay({"metadata": metadata, "spec": pod_spec}, spec, pod_labels)


def _apply_overlay(template: dict[str, Any], spec: InferenceServiceSpec,
                   pod_labels: dict[str, str]) -> dict[str, Any]:
    """spec.pod.template merged last (strategic merge); the operator's labels win so selectors stay intact."""
    if not spec.pod.template:
        return template
    try:
        template = overlay.strategic_merge(template, spec.pod.template)
    except overlay.OverlayError as e:
        raise api.SpecError(f"spec.pod.template.{e.path}", e.message) from None
    template.setdefault("metadata", {}).setdefault("labels", {}).update(pod_labels)
    return template


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _workload_labels(spec: InferenceServiceSpec) -> dict[str, str]:
    """Labels of the pods' own that belong on the workload object too: Kueue reads the queue name from the
    Deployment or StatefulSet it admits, not from the pod template."""
    return {k: v for k, v in spec.pod.labels.items() if k == KUEUE_QUEUE_LABEL}


def deployment(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_meta(isvc, name, "engine", _workload_labels(spec)),
                     "annotations": {upgrade.A_RENDERED_IMAGE: settings.engine_image}},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": pod_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxUnavailable": spec.rollout.max_unavailable, "maxSurge": spec.rollout.max_surge}},
            "revisionHistoryLimit": 5,
            # a rollout stalls visibly (Progressing=False) once the model-load budget is long past
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + 600,
            "template": pod_template(isvc, spec, settings),
        },
    })


def canary_deployment(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    """The canary revision's Deployment `<name>-canary`, rendered from its whole spec (api.canary_spec): its pods
    carry L_CANARY=true besides the engine labels, so the engines Service (and the NetworkPolicy, the disruption
    budget) covers them as well, and its own selector only them."""
    name = isvc["metadata"]["name"]
    dep = deployment(isvc, spec, settings)
    dep["metadata"]["name"] = canary_name(name)
    dep["metadata"]["labels"][L_CANARY] = "true"
    dep["spec"]["selector"] = {"matchLabels": {**pod_selector(name), L_CANARY: "true"}}
    dep["spec"]["template"]["metadata"]["labels"][L_CANARY] = "true"
    del dep["metadata"]["annotations"][A_SPEC_HASH]
    return _finish(dep)


def prefill_deployment(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    """spec.prefill's Deployment `<name>-prefill`: engines of the same model and options started as KV producers,
    with the prefill role's replicas and CPU/memory. Their pods are labelled component=prefill, so the engines
    Service, NetworkPolicy and disruption budget (component=engine) leave them out; `<name>-prefill` (a headless
    Service) lists them for the gateway."""
    name, p = isvc["metadata"]["name"], spec.prefill
    sized = {k: v for k, v in (("cpu", p.cpu), ("memory", p.memory)) if v is not None}
    role_spec = spec.model_copy(update={"replicas": p.replicas,
                                        "resources": spec.resources.model_copy(update=sized)})
    return _finish({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_meta(isvc, prefill_name(name), "prefill", _workload_labels(spec)),
                     "annotations": {upgrade.A_RENDERED_IMAGE: settings.engine_image}},
        "spec": {
            "replicas": p.replicas,
            "selector": {"matchLabels": prefill_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxUnavailable": spec.rollout.max_unavailable, "maxSurge": spec.rollout.max_surge}},
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + 600,
            "template": pod_template(isvc, role_spec, settings, role="prefill"),
        },
    })


def group_revision(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> str:
    """Everything the spec puts into a group, hashed without the group's index (the same for every group)."""
    return statefulset(isvc, spec, settings, 0, "")["metadata"]["annotations"][A_SPEC_HASH]


def statefulset(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings, replica: int,
                revision: str) -> dict:
    name = isvc["metadata"]["name"]
    group = group_name(name, replica)
    pods = spec.pods_per_replica(settings.max_gpus_per_node)
    meta = _meta(isvc, group, "engine", {**_workload_labels(spec), L_GROUP: str(replica)})
    meta["annotations"] = {A_GROUP_SIZE: str(pods), A_REVISION: revision,
                           upgrade.A_RENDERED_IMAGE: settings.engine_image}
    return _finish({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": pods,
            "serviceName": group,
            "podManagementPolicy": "Parallel",
            # the operator restarts whole groups (a torch.distributed job cannot swap one rank)
            "updateStrategy": {"type": "OnDelete"},
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": {**pod_selector(name), L_GROUP: str(replica)}},
            "template": pod_template(isvc, spec, settings, replica=replica),
            **({"volumeClaimTemplates": [{"metadata": {"name": "cache"}, "spec": _claim_spec(spec)}],
                # a group's claims go with it; kept while it only scales, as ranks restart in place
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"}}
               if _per_pod_cache(spec) else {}),
        },
    })
