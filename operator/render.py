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
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from shoal.operator import adapters, api, canary, contract, overlay, runtimes, upgrade
from shoal.operator.gateway import options as gateway_options
from shoal.operator.gateway.proxy import GatewayConfig
from shoal.operator.podtools.modelcache import entry_key
from shoal.operator.api import ENGINE_PORT, MASTER_PORT, InferenceServiceSpec

DEFAULT_ENGINE_IMAGE = "ghcr.io/shoal-dev/shoal-engine:0.1.0"
# shoal-gateway needs no torch: the operator's small image (Dockerfile.operator) carries it.
DEFAULT_GATEWAY_IMAGE = "ghcr.io/shoal-dev/shoal-operator:0.1.0"
# The pods' helper containers (shoal-podtools: the model download, the adapter sync) run from the operator image,
# whatever the engine's runtime: the engine image carries no operator code.
DEFAULT_FLEET_IMAGE = "ghcr.io/shoal-dev/shoal-operator:0.1.0"
PODTOOLS = "shoal-podtools"
GATEWAY_UID = 65532  # the operator image's user

# names, labels and annotations: the InferenceService contract (contract.py), which the gateway reads by too
from shoal.operator.contract import (A_GROUP_SIZE, A_REVISION, A_SPEC_HASH, L_CANARY, L_CANARY_PERCENT,  # noqa: E402
                                     L_COMPONENT, L_GROUP, L_INSTANCE, L_ISVC, L_MANAGED_BY, L_NAME, L_PART_OF,
                                     L_POD_INDEX, MANAGED_BY, MODELS_DIR,
                                     canary_name, engines_service_name, gateway_name, wake_configmap_name)

DOWNLOAD_CONTAINER = "model-download"  # init container that fetches hf:// models (status.py watches it)
CACHE_DIR = "/cache"
MODEL_CACHE_DIR = f"{CACHE_DIR}/shoal/models"  # the model cache's root on the volume (podtools/modelcache.py)
# The engine mounts /cache read-only (the model cache other pods share, the adapters the sidecar fetched); what it
# writes itself — JIT-built kernels, a runtime's compile caches, the demo model — goes to this writable subPath of
# the same volume, so on a claim it outlives the pod like the models do.
ENGINE_CACHE_DIR = "/engine-cache"
ENGINE_CACHE_SUBPATH = "shoal/engine"
LEASE_CONTAINER = "model-cache-lease"  # native sidecar keeping the pod's lease on its cache entry (shared caches)
CHAT_TEMPLATE_DIR = "/etc/shoal/chat-template"
CHAT_TEMPLATE_KEY = "template.jinja"


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


def group_name(name: str, replica: int) -> str:
    return f"{name}-g{replica}"


def pod_selector(name: str) -> dict[str, str]:
    return {L_ISVC: name, L_COMPONENT: "engine"}


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


# ------------------------------------------------------------------------------------------------- the engine pod
def model_path(spec: InferenceServiceSpec) -> str | None:
    """What the engine loads: the model cache's entry the init container filled (hf://), a path on the mounted
    claim or image volume, or in the image; None for demo:// (the engine's built-in demo model)."""
    uri = spec.model.uri
    if uri.startswith("hf://"):
        return f"{MODEL_CACHE_DIR}/{entry_key(uri[len('hf://'):], spec.model.revision)}"
    if uri.startswith("oci://"):
        return MODELS_DIR
    if uri.startswith("pvc://"):
        _claim, _, path = uri[len("pvc://"):].partition("/")
        return f"{MODELS_DIR}/{path}".rstrip("/")
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return None


def engine_args(name: str, namespace: str, spec: InferenceServiceSpec, settings: Settings, *,
                replica: int | None = None) -> list[str]:
    """Arguments of the runtime's server (after its command): spec.engine through the runtime's table."""
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
    if precise_prefix(spec):  # vLLM's flag, the same JSON for both runtimes; before extraArgs
        at = len(args) - len(spec.engine.extra_args)
        args[at:at] = ["--kv-events-config", kv_events_config(name, namespace)]
    if rt.name == "shoal" and spec.gpus_per_pod(settings.max_gpus_per_node) == 0:
        args += ["--device", "cpu"]  # never `auto`: a GPU the node's runtime leaks in must not be picked
    return args


# precise-prefix routing: each engine publishes its KV events (vLLM's format) on these ports of its pod IP, and the
# gateway subscribes to every ready engine there (operator/gateway/kv_subscriber.py).
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558


def precise_prefix(spec: InferenceServiceSpec) -> bool:
    return spec.gateway.enabled and spec.gateway.routing == "precise-prefix"


def kv_events_topic(name: str, namespace: str) -> str:
    return f"kv@{namespace}/{name}"


def kv_events_config(name: str, namespace: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                       "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": kv_events_topic(name, namespace)},
                      separators=(",", ":"))


def kv_events_ports(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if not precise_prefix(spec):
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]


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
                      mounts: list[dict[str, Any]]) -> dict[str, Any]:
    name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
    rt = runtimes.of(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image or rt.image or settings.engine_image,
        **runtimes.argv(rt, multi, engine_args(name, namespace, spec, settings, replica=replica)),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
                 + ([{"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"}] if multi else [])
                 + kv_events_ports(spec),
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


def _download_container(spec: InferenceServiceSpec, image: str, env: list[dict[str, Any]],
                        mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The init container that fills the cache volume with an hf:// model: the engine never downloads (HF_TOKEN
    may come from spec.env)."""
    download_args = _cache_args(spec)
    if (cap := cache_cap(spec)) is not None:
        download_args += ["--max-cache-bytes", str(cap)]
    container = {
        "name": DOWNLOAD_CONTAINER,
        "image": image,
        "command": [PODTOOLS],
        "args": ["download", *download_args],
        "env": [e for e in env if e["name"] != "HF_HUB_OFFLINE"],
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")],
        # a download is network and disk bound; requests keep the pod out of BestEffort while it runs,
        # the limit bounds the hub client's parallel buffers
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}},
        "securityContext": _restricted_container(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _cache_args(spec: InferenceServiceSpec) -> list[str]:
    out = ["--model", spec.model.uri[len("hf://"):]]
    if spec.model.revision:
        out += ["--revision", spec.model.revision]
    return out + ["--cache-dir", MODEL_CACHE_DIR]


def cache_cap(spec: InferenceServiceSpec) -> int | None:
    """The model cache's size cap in bytes: its size (what LRU eviction keeps the cache under), else the bound of
    the pod's own cache volume; None: unbounded."""
    from kubernetes.utils import parse_quantity

    size = spec.cache_size() if _cache_claimed(spec) else cache_bound(spec)
    return int(parse_quantity(str(size))) if size is not None else None


def _lease_container(spec: InferenceServiceSpec, image: str, env: list[dict[str, Any]],
                     mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """A native sidecar (restartPolicy Always: it starts before the engine and stops after it) that keeps this
    pod's lease on the cache entry fresh, so eviction for another model never removes the one it runs."""
    container = {
        "name": LEASE_CONTAINER,
        "image": image,
        "command": [PODTOOLS],
        "args": ["cache-lease", *_cache_args(spec)],
        "restartPolicy": "Always",
        "env": [e for e in env if e["name"] != "HF_HUB_OFFLINE"],
        "volumeMounts": [m for m in mounts if m["name"] == "cache"],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": _restricted_container(),
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
                 replica: int | None = None) -> dict[str, Any]:
    """The engine pod: its container, volumes and probes, placement, then the user's overlay (spec.pod.template)."""
    name = isvc["metadata"]["name"]
    multi = spec.pods_per_replica(settings.max_gpus_per_node) > 1
    pod_labels = labels(name, "engine")
    if multi:
        pod_labels[L_GROUP] = str(replica)

    env = _engine_env(spec, multi, spec.gpus_per_pod(settings.max_gpus_per_node))
    volumes, mounts = _volumes(name, spec)
    container = _engine_container(isvc, spec, settings, replica=replica, multi=multi, env=env, mounts=mounts)
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


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def _per_pod_cache(spec: InferenceServiceSpec) -> bool:
    return spec.model.cache.persistent and spec.model.cache.access_mode == "ReadWriteOnce"


def _shared_cache(spec: InferenceServiceSpec) -> bool:
    """Is /cache a volume several pods use (an existing claim, or the operator's shared ReadWriteMany claim)?"""
    return bool(spec.model.cache.claim_name) or (spec.model.cache.persistent and not _per_pod_cache(spec))


def _cache_claimed(spec: InferenceServiceSpec) -> bool:
    return bool(spec.model.cache.claim_name or spec.model.cache.persistent)


def cache_location(name: str, spec: InferenceServiceSpec) -> str:
    """Where the model cache is, in words (status.modelCache.volume)."""
    if spec.model.cache.claim_name:
        return f"persistentVolumeClaim {spec.model.cache.claim_name}, shared by every pod that mounts it"
    if _per_pod_cache(spec):
        return "each pod's own persistentVolumeClaim (volumeClaimTemplates): the newest pod's is listed"
    if spec.model.cache.persistent:
        return f"persistentVolumeClaim {cache_claim_name(name)}, shared by the service's pods"
    return "each pod's own emptyDir: the newest pod's is listed"


def cache_volume(name: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The /cache volume: an existing claim, the operator's shared claim, none (a StatefulSet's per-pod claim
    from volumeClaimTemplates) or an emptyDir."""
    cache = spec.model.cache
    if cache.claim_name:
        return [{"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}]
    if _per_pod_cache(spec):
        return []
    if cache.persistent:
        return [{"name": "cache", "persistentVolumeClaim": {"claimName": cache_claim_name(name)}}]
    size = cache_bound(spec)
    return [{"name": "cache", "emptyDir": {"sizeLimit": str(size)} if size is not None else {}}]


# LoRA adapters fetched from the hub land in the pod's cache too: with a model that is not downloaded (pvc://,
# file://) and no model.cache.size, the cache still gets this bound, so a long adapter list cannot fill the node.
ADAPTER_CACHE_BOUND = "50Gi"
# The adapter sidecar starts no hub download once the cache holds this share of its bound: an adapter is refused
# (Failed, retried later) instead of the kubelet evicting the pod for exceeding the emptyDir's sizeLimit.
ADAPTER_CACHE_SHARE = 0.9


def cache_bound(spec: InferenceServiceSpec) -> int | str | None:
    """The size the pod's own /cache may reach (an emptyDir's sizeLimit, a per-pod claim's size); None: unbounded
    (a claim other pods share is sized by whoever made it)."""
    size = spec.cache_size()
    if size is None and spec.model.uri.startswith("hf://"):
        size = default_download_bound(spec)
    if size is None and spec.engine.enable_lora and not _cache_claimed(spec):  # not the list: no rollout on edits
        size = ADAPTER_CACHE_BOUND
    return size


def adapter_cache_cap(spec: InferenceServiceSpec) -> int | None:
    """The sidecar's --max-cache-bytes: a share of the pod's own cache bound (None: a shared or unbounded cache)."""
    from kubernetes.utils import parse_quantity

    bound = None if _shared_cache(spec) else cache_bound(spec)
    return int(int(parse_quantity(str(bound))) * ADAPTER_CACHE_SHARE) if bound is not None else None


# An hf:// download without model.cache.size still gets a sizeLimit, so a wrong model id (a 400 B checkpoint for a
# one-GPU service) cannot fill the node's disk and evict its neighbours: the kubelet evicts this pod instead. The
# bound is what the replica could possibly serve — its weights must fit its accelerators' memory, or on CPU the
# pod's memory — times what quantizing on load may shrink (bf16 -> int4 is 4x). GPU memory is not in the spec, so
# each GPU counts for 160Gi (an H200 has 141 GB, a B200 180 GiB... the largest in common use, rounded up). Without a
# `memory` a CPU replica gets 100Gi. No ephemeral-storage request comes with it: a request this large would keep
# the pod off nodes whose disks hold the real model easily (set model.cache.size for a request and a tight bound).
DOWNLOAD_BOUND_PER_GPU = 160 * 2**30
DOWNLOAD_BOUND_CPU_DEFAULT = 100 * 2**30
QUANTIZE_ON_LOAD_RATIO = 4


def default_download_bound(spec: InferenceServiceSpec) -> str:
    """The emptyDir sizeLimit of an hf:// model cache when the spec sets no size (see above)."""
    from kubernetes.utils import parse_quantity

    if spec.resources.gpus_per_pod != 0:  # None: the default, which is GPUs
        bound = spec.world_size * DOWNLOAD_BOUND_PER_GPU
    elif spec.resources.memory is not None:
        bound = QUANTIZE_ON_LOAD_RATIO * int(parse_quantity(str(spec.resources.memory)))
    else:
        bound = DOWNLOAD_BOUND_CPU_DEFAULT
    return f"{math.ceil(bound / 2**30)}Gi"


def _claim_spec(spec: InferenceServiceSpec) -> dict[str, Any]:
    claim: dict[str, Any] = {"accessModes": [spec.model.cache.access_mode],
                             "resources": {"requests": {"storage": str(spec.cache_size())}}}
    if spec.model.cache.storage_class_name:
        claim["storageClassName"] = spec.model.cache.storage_class_name
    return claim


# ------------------------------------------------------------------------------------------------------ children
def cache_claim(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """One ReadWriteMany claim shared by every pod, every rollout and restart: the model is downloaded once."""
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(isvc, cache_claim_name(name), "model-cache"),
        "spec": _claim_spec(spec),
    })


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


def headless_service(isvc: dict[str, Any], spec: InferenceServiceSpec, replica: int) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    group = group_name(name, replica)
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, group, "ranks", {L_GROUP: str(replica)}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # ranks find rank 0 while the group is still forming
            "selector": {**pod_selector(name), L_GROUP: str(replica)},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                      {"name": "dist", "port": MASTER_PORT, "targetPort": "dist", "protocol": "TCP"}],
        },
    })


def serving_selector(name: str, multi: bool) -> dict[str, str]:
    """The engine pods that serve the OpenAI API: every pod, or rank 0 of each multi-pod group."""
    selector = pod_selector(name)
    if multi:
        selector[L_POD_INDEX] = "0"  # only rank 0 serves the OpenAI API
    return selector


def gateway_service(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    selector = gateway_selector(name) if spec.gateway.enabled else serving_selector(name, multi)
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if spec.gateway.enabled:  # in its EndpointSlices, where the autoscaler finds the gateways' metrics listener
        ports.append(gateway_metrics_service_port())
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, name, "gateway"),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    })


def _scraper_rules(spec: InferenceServiceSpec, settings: Settings,
                   ports: tuple[int, ...] = (ENGINE_PORT,)) -> list[dict[str, Any]]:
    """Prometheus (and the operator's autoscaler) reach /metrics, served on the HTTP port of engines and gateways
    alike (routes other than health and metrics still need the API key): the operator's namespace, every
    --metrics-namespace and security.networkPolicy.metricsFrom."""
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
                for ns in dict.fromkeys(filter(None, (settings.operator_namespace, *settings.metrics_namespaces)))]
    scrapers += copy.deepcopy(spec.security.network_policy.metrics_from)
    return [{"from": scrapers, "ports": [{"port": p, "protocol": "TCP"} for p in ports]}] if scrapers else []


def network_policy(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings, multi: bool) -> dict:
    name = isvc["metadata"]["name"]
    http = [{"port": ENGINE_PORT, "protocol": "TCP"}]
    if spec.gateway.enabled:  # clients -> gateway -> engines: only the gateway reaches the engines' API
        peers = [{"podSelector": {"matchLabels": gateway_selector(name)}}]
        if spec.inference_pool is not None:  # and the extension's Gateway, which sends straight to the engines
            peers += copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    else:
        peers = copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    peers += shared_gateway_peers(settings)
    rules: list[dict[str, Any]] = [{"from": peers, "ports": http}, *_scraper_rules(spec, settings)]
    if precise_prefix(spec):  # the service's own gateway subscribes to the engines' KV events
        rules.append({"from": [{"podSelector": {"matchLabels": gateway_selector(name)}}],
                      "ports": [{"port": KV_EVENTS_PORT, "protocol": "TCP"}, {"port": KV_REPLAY_PORT, "protocol": "TCP"}]})
    if spec.engine.enable_lora and settings.operator_namespace:  # the operator reads the adapter-sync sidecars
        rules.append({"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": settings.operator_namespace}}}],
            "ports": [{"port": adapters.SIDECAR_PORT, "protocol": "TCP"}]})
    if multi:
        # torch.distributed: rendezvous on 29500, NCCL/gloo on ephemeral ports -> every port, same service only
        rules.append({"from": [{"podSelector": {"matchLabels": pod_selector(name)}}]})
    return _finish({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, name, "network-policy"),
        "spec": {"podSelector": {"matchLabels": pod_selector(name)}, "policyTypes": ["Ingress"], "ingress": rules},
    })


def disruption_budget(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, name, "disruption-budget"),
        # one pod at a time: for multi-pod replicas that is one group at a time
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_selector(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


# ------------------------------------------------------------------------------------------------------ the gateway
def engines_service(isvc: dict[str, Any], spec: InferenceServiceSpec, multi: bool,
                    canary_percent: int | None = None) -> dict[str, Any]:
    """Headless: no virtual IP, it exists for its EndpointSlices (Ready serving engines), which the gateway watches.
    With a canary its label L_CANARY_PERCENT carries the canary's share to the gateways (through the slices)."""
    name = isvc["metadata"]["name"]
    extra = {L_CANARY_PERCENT: str(canary_percent)} if canary_percent is not None else None
    return _finish({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, engines_service_name(name), "engines", extra),
        "spec": {
            "clusterIP": "None",
            "selector": serving_selector(name, multi),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


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


def gateway_rbac(isvc: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The gateway's identity: it may list and watch EndpointSlices in its namespace, read its own InferenceService
    (spec.adapters: gateway/own_service.py), and, when the fleet can scale to zero, patch its wake-up ConfigMap to
    wake the autoscaler (operator/gateway/wake.py); nothing else."""
    name = isvc["metadata"]["name"]
    gw = gateway_name(name)
    rules = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
             # its own InferenceService, read by name (shoal-gateway --inference-service): the adapters it declares
             {"apiGroups": [contract.GROUP], "resources": [contract.PLURAL], "resourceNames": [name],
              "verbs": ["get", "list", "watch"]}]
    if scales_from_zero(spec):
        rules.append({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [wake_configmap_name(name)],
                      "verbs": ["patch"]})
    return [
        _finish({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(isvc, gw, "gateway"),
                 "automountServiceAccountToken": False}),  # mounted by the gateway pod alone
        _finish({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(isvc, gw, "gateway"),
                 "rules": rules}),
        _finish({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": _meta(isvc, gw, "gateway"),
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": gw},
                 "subjects": [{"kind": "ServiceAccount", "name": gw, "namespace": isvc["metadata"]["namespace"]}]}),
    ]


# The gateways' /metrics on a listener of its own, which Istio's sidecar leaves out of its mTLS: the operator's
# autoscaler, outside the mesh, reads the engines' load there when it cannot scrape mesh-only engines
# (spec.autoscaling.loadSource). The port serves /metrics and nothing else; the NetworkPolicy admits only scrapers.
GATEWAY_METRICS_PORT = 9090


def gateway_metrics_service_port() -> dict[str, Any]:
    return {"name": "metrics", "port": GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}


def gateway_metrics_listener() -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """(the gateway's args, its container port, its pod annotations) for the metrics listener."""
    return (["--metrics-port", str(GATEWAY_METRICS_PORT)],
            {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
            {A_ISTIO_EXCLUDE_INBOUND: str(GATEWAY_METRICS_PORT)})


def gateway_limit_args(gw: api.GatewayOptions) -> list[str]:
    """spec.gateway's shoal-gateway options (routing, timeouts, admission limits) as its flags: the declaration on
    GatewayConfig says which field is which flag (gateway/options.py)."""
    return gateway_options.to_args(GatewayConfig, gw)


# What one gateway process holds at most (operator/gateway): the interpreter with aiohttp and prometheus_client, the
# prefix index at its cap (200,000 hashes: 63 MiB measured with tracemalloc, one engine a hash; 512 B a hash
# leaves room for hashes several engines hold), the
# request bodies (max_buffered_bytes, kept until the answer starts) and per pending request its connection, task,
# parsed headers and relay buffers.
GATEWAY_BASE_BYTES = 160 * 2**20
GATEWAY_INDEX_BYTES = 200_000 * 512
GATEWAY_PER_REQUEST_BYTES = 32 * 2**10
# gateway.batches: a batch's parsed requests stay in memory while it runs (~3x its input file, measured on chat
# lines) and an input file being checked is read whole: room for one largest file (200 MiB) running and another
# being checked. Several large batches at once need gateway.resources.memory.
GATEWAY_BATCH_BYTES = 4 * 200 * 2**20


def gateway_memory(gw: api.GatewayOptions) -> str:
    """The gateway's memory request and limit: spec.gateway.resources.memory, else the sum of its bounds."""
    if gw.resources.memory is not None:
        return str(gw.resources.memory)
    total = (GATEWAY_BASE_BYTES + GATEWAY_INDEX_BYTES + gw.max_buffered_bytes
             + gw.max_pending * GATEWAY_PER_REQUEST_BYTES + (GATEWAY_BATCH_BYTES if gw.batches.enabled else 0))
    return f"{math.ceil(total / 2**20)}Mi"


GATEWAY_BATCH_DIR = "/var/lib/shoal-gateway/batches"  # the gateway's --batch-dir, on the batch volume


def batches_claim_name(name: str) -> str:
    return f"{name}-gateway-batches"


def gateway_batches_claim(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """The gateway's batch volume (gateway.batches): owned by the InferenceService, not by the gateway's
    Deployment, so users' files and results outlive every gateway roll and go with the service."""
    b = spec.gateway.batches
    claim: dict[str, Any] = {"accessModes": [b.access_mode], "resources": {"requests": {"storage": str(b.size)}}}
    if b.storage_class_name:
        claim["storageClassName"] = b.storage_class_name
    return _finish({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(isvc, batches_claim_name(isvc["metadata"]["name"]), "gateway-batches"),
        "spec": claim,
    })


def gateway_batches_volume(name: str, spec: InferenceServiceSpec) -> tuple[list[str], dict, dict]:
    """(args, volume, volumeMount) of the batch volume."""
    claim = spec.gateway.batches.existing_claim or batches_claim_name(name)
    return (["--batch-dir", GATEWAY_BATCH_DIR], {"name": "batches", "persistentVolumeClaim": {"claimName": claim}},
            {"name": "batches", "mountPath": GATEWAY_BATCH_DIR})


def gateway_deployment(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict[str, Any]:
    name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
    gw, res = spec.gateway, spec.gateway.resources
    memory = gateway_memory(gw)
    requests = {"memory": memory, **({"cpu": str(res.cpu)} if res.cpu is not None else {})}
    resources: dict[str, Any] = {"requests": requests, "limits": {"memory": memory}}
    # In-flight streams may run as long as the engines' drain allows.
    drain = spec.engine.shutdown_timeout_seconds
    hold_args: list[str] = []
    if scales_from_zero(spec):
        # At zero replicas requests wait for the first engine — a GPU node to be provisioned, the image pulled,
        # the model loaded: its whole model-load budget — and the gateway wakes the autoscaler at once by
        # annotating its wake-up ConfigMap.
        hold = spec.probes.startup_timeout_seconds
        hold_args = ["--hold-timeout", str(hold), "--wake-configmap", wake_configmap_name(name)]
        if spec.autoscaling.scale_to_zero == "sleep":  # a held request wakes a parked engine directly
            hold_args.append("--wake-engines")
    metrics_args, metrics_port, metrics_annotations = gateway_metrics_listener()
    volumes, mounts = (api_key_volume(spec), [API_KEYS_MOUNT]) if spec.security.api_key_secret_ref else ([], [])
    batch_args: list[str] = []
    if gw.batches.enabled:
        batch_args, volume, mount = gateway_batches_volume(name, spec)
        volumes, mounts = [*volumes, volume], [*mounts, mount]
    container = {
        "name": "gateway",
        "image": gw.image or settings.gateway_image,
        "command": ["shoal-gateway"],
        "args": ["--service", engines_service_name(name), "--namespace", namespace, "--inference-service", name,
                 "--port-name", "http",
                 "--port", str(ENGINE_PORT), "--shutdown-timeout", str(drain)]
                + gateway_limit_args(gw) + hold_args + metrics_args + batch_args
                # which readiness path and load metrics the engines have (metric_names.py); shoal's are the default
                # the engines' keys, every line of the mounted Secret, re-read when it is rotated
                + (["--api-key-file", API_KEYS_FILE] if spec.security.api_key_secret_ref else [])
                # engines that schedule by priority get the gateway's, never a client's (proxy.engine_body)
                + (["--engine-priority"] if spec.engine.scheduling_policy == "priority" else [])
                + (["--runtime", spec.runtime] if spec.runtime != "shoal" else [])
                + (["--kv-events-port", str(KV_EVENTS_PORT), "--kv-events-replay-port", str(KV_REPLAY_PORT),
                    "--kv-events-topic", kv_events_topic(name, namespace)] if precise_prefix(spec) else []),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}, metrics_port],
        **({"env": env} if (env := tracing_env(isvc, spec)) else {}),
        # The engines' keys, so the gateway answers 401 itself: an unauthenticated request is never held, never
        # counted as load and never wakes the autoscaler; the batch volume.
        **({"volumeMounts": mounts} if mounts else {}),
        "resources": resources,
        "readinessProbe": _probe("/readyz", 2, 2, 2),
        "livenessProbe": _probe("/livez", 10, 3, 5),
        "lifecycle": {"preStop": {"sleep": {"seconds": settings.prestop_seconds}}},
        "securityContext": _restricted_container(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "serviceAccountName": gateway_name(name),
        "automountServiceAccountToken": True,  # it watches EndpointSlices
        "enableServiceLinks": False,
        "containers": [container],
        "terminationGracePeriodSeconds": drain + settings.prestop_seconds + 15,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": GATEWAY_UID,
            "runAsGroup": GATEWAY_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Replicas on different nodes when possible: one node going away keeps the API up.
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": gateway_selector(name)}}],
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if volumes:
        pod_spec["volumes"] = volumes
    if gw.batches.enabled:  # the batch volume is writable by the gateway's group; chown only a new volume
        pod_spec["securityContext"].update({"fsGroup": GATEWAY_UID, "fsGroupChangePolicy": "OnRootMismatch"})
    return _finish({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, gateway_name(name), "gateway"),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": gateway_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels(name, "gateway"), "annotations": metrics_annotations},
                         "spec": pod_spec},
        },
    })


def gateway_network_policy(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings) -> dict:
    """Clients (`allowFrom`, else only the namespace's pods: an ingress controller in another namespace needs an
    allowFrom peer) reach the gateway; the metrics scrapers, as for the engines, its /metrics."""
    name = isvc["metadata"]["name"]
    http = [{"port": ENGINE_PORT, "protocol": "TCP"}]
    peers = copy.deepcopy(spec.security.network_policy.allow_from) or [{"podSelector": {}}]
    rules: list[dict[str, Any]] = [{"from": peers, "ports": http},
                                   *_scraper_rules(spec, settings, ports=(ENGINE_PORT, GATEWAY_METRICS_PORT))]
    return _finish({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, gateway_name(name), "network-policy"),
        "spec": {"podSelector": {"matchLabels": gateway_selector(name)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    })


def gateway_disruption_budget(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, gateway_name(name), "disruption-budget"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": gateway_selector(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


def gateway_children(isvc: dict[str, Any], spec: InferenceServiceSpec, settings: Settings,
                     multi: bool, canary_percent: int | None = None) -> list[dict[str, Any]]:
    children = [engines_service(isvc, spec, multi, canary_percent), *gateway_rbac(isvc, spec),
                gateway_deployment(isvc, spec, settings), gateway_disruption_budget(isvc, spec)]
    if scales_from_zero(spec):
        children.append(wake_configmap(isvc, spec))
    if spec.gateway.batches.enabled and not spec.gateway.batches.existing_claim:
        children.append(gateway_batches_claim(isvc, spec))
    if spec.security.network_policy.enabled:
        children.append(gateway_network_policy(isvc, spec, settings))
    return children


def adapters_configmap(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """spec.adapters as the pods' adapter-sync sidecars read it (mounted; the kubelet refreshes it in place)."""
    return _finish({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, adapters.configmap_name(isvc["metadata"]["name"]), "adapters"),
        "data": {adapters.CONFIG_KEY: adapters.config(spec)},
    })


# ------------------------------------------------------------------------------------------- the shared gateway
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


# ------------------------------------------------------------------------ Gateway API Inference Extension children
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


def chat_template_configmap(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, f"{name}-chat-template", "chat-template"),
        "data": {CHAT_TEMPLATE_KEY: spec.model.chat_template or ""},
    })


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
    children.append(gateway_service(isvc, spec, multi))
    if spec.security.network_policy.enabled:
        children.append(network_policy(isvc, spec, settings, multi))
    if spec.replicas > 1:
        children.append(disruption_budget(isvc, spec))
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
