"""The model cache: where the model lies in a pod, the cache volume (emptyDir, per-pod claim template or a
shared PersistentVolumeClaim) and its size bounds, the model-download init container and the lease sidecar that
shoal-podtools run, and the shared cache's claim. Separate because its volume and sizing rules are a concern of
their own that the engine pod only consumes.
"""

from __future__ import annotations

import math
from typing import Any

from shoal.operator.api import InferenceServiceSpec
from shoal.operator.podtools.modelcache import entry_key
from shoal.operator.contract import MODELS_DIR
from shoal.operator.render.common import PODTOOLS, _finish, _meta
from shoal.operator.render.containers import _restricted_container


DOWNLOAD_CONTAINER = "model-download"  # init container that fetches hf:// models (status.py watches it)
CACHE_DIR = "/cache"
MODEL_CACHE_DIR = f"{CACHE_DIR}/shoal/models"  # the model cache's root on the volume (podtools/modelcache.py)
LEASE_CONTAINER = "model-cache-lease"  # native sidecar keeping the pod's lease on its cache entry (shared caches)


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


def _download_container(spec: InferenceServiceSpec, image: str, env: list[dict[str, Any]],
                        mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The init container that fills the cache volume with an hf:// model: the engine never downloads (HF_TOKEN
    may come from spec.env)."""
    download_args = _cache_args(spec)
    if (cap := cache_cap(spec)) is not None:
        download_args += ["--max-cache-bytes", str(cap)]
    # a download is network and disk bound; requests keep the pod out of BestEffort while it runs,
    # the limit bounds the hub client's parallel buffers
    return _podtools_container(spec, DOWNLOAD_CONTAINER, image, ["download", *download_args], env,
                               [m for m in mounts if m["name"] in ("cache", "tmp")],
                               {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}})


def _podtools_container(spec: InferenceServiceSpec, name: str, image: str, args: list[str],
                        env: list[dict[str, Any]], mounts: list[dict[str, Any]], resources: dict[str, Any],
                        **extra: Any) -> dict[str, Any]:
    """A shoal-podtools container of the engine pod: the hub's offline switch dropped (these are the parts that
    may reach the hub), restricted, the pull policy the spec asks for."""
    container = {"name": name, "image": image, "command": [PODTOOLS], "args": args, **extra,
                 "env": [e for e in env if e["name"] != "HF_HUB_OFFLINE"], "volumeMounts": mounts,
                 "resources": resources, "securityContext": _restricted_container(),
                 "terminationMessagePolicy": "FallbackToLogsOnError"}
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
    return _podtools_container(spec, LEASE_CONTAINER, image, ["cache-lease", *_cache_args(spec)], env,
                               [m for m in mounts if m["name"] == "cache"],
                               {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                               restartPolicy="Always")


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


def cache_claim(isvc: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """One ReadWriteMany claim shared by every pod, every rollout and restart: the model is downloaded once."""
    name = isvc["metadata"]["name"]
    return _finish({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(isvc, cache_claim_name(name), "model-cache"),
        "spec": _claim_spec(spec),
    })
