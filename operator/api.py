"""The InferenceService API (serving.shoal.dev/v1alpha1): the single source of truth.

The pydantic models below define the spec and status once: field names (camelCase on the wire), defaults,
enums and ranges. ``shoal.operator.crdgen`` turns them into the CRD's structural openAPIV3Schema, and the
operator validates every object it reconciles with them (so a cluster without CEL, or an object created
before the CRD was updated, still gets the same checks, reported as ``Ready=False, reason=InvalidSpec``).

Cross-field rules live in ``CROSS_FIELD_RULES``: each is a CEL expression for the CRD (``x-kubernetes-
validations``) paired with the equivalent Python check, so both sides say the same thing with the same message.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)
from pydantic.alias_generators import to_camel

from shoal.engine import flags
from shoal.engine.config import (AttentionBackend, Dtype, EngineConfig, MultiModalLimits, PoolerConfig, PoolingType,
                                 Runner)
from shoal.engine.execution.models import SUPPORTED_ARCHITECTURES  # the registry imports without torch
from shoal.operator import runtimes  # reads the spec's models from the spec it is given, never imports this module
from shoal.operator.errors import SpecError  # runtimes raises it too
from shoal.operator.gateway import options as gateway_options
from shoal.operator.gateway.proxy import GatewayConfig  # declares the gateway's options (CLI flags, spec.gateway)

from shoal.operator import contract  # noqa: E402
from shoal.operator.contract import API_VERSION, GROUP, KIND, PLURAL, VERSION  # noqa: E402,F401 (the contract's)

SINGULAR = "inferenceservice"
# `kubectl get isvc` is what users expect. KServe uses "isvc" too, and a cluster running both resolves it to one
# of the two CRDs, so "sisvc" is registered as well: it never clashes (nor does inferenceservices.serving.shoal.dev).
SHORT_NAMES = ["isvc", "sisvc"]
# not "all": `kubectl delete all --all` must never delete models
CATEGORIES = ["shoal"]
# Versioning (docs/api.md "Versions"): every version the CRD serves, oldest first, and the one the API server
# stores. All share this one schema (conversion strategy None: the API server only rewrites apiVersion), so a new
# version is added here, made the storage version once it has been served for a release, and the old one is kept
# served (deprecated) until stored objects are migrated.
SERVED_VERSIONS: tuple[str, ...] = (VERSION,)
STORAGE_VERSION = VERSION

ENGINE_PORT = 8000  # HTTP, metrics and health on every rank
MASTER_PORT = 29500  # torch.distributed rendezvous on rank 0 of a multi-pod group
DEMO_URI = "demo://"

# hf://org/name  |  pvc://claim[/path]  |  file:///absolute/path (inside the image)  |  demo://
# an OCI model image: registry host (with a dot or a port, or localhost) / repository, then a tag and/or a digest
OCI_REFERENCE = (r"^(localhost|[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)+|[a-zA-Z0-9.-]+:[0-9]+)(:[0-9]+)?"
                 r"/[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
                 r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
URI_PATTERN = r"^(demo://|hf://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|file:///.*|oci://.+)$"
# LoRA adapters come from the same places as models, except the demo: hf://org/name, pvc://claim/path, file:///path
ADAPTER_URI_PATTERN = (r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.+"
                       r"|file:///.+)$")
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"

RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "serving.shoal.dev/", "apps.kubernetes.io/",
                           "controller-revision-hash", "statefulset.kubernetes.io/", "pod-template-hash")


def is_quantity(v: int | str) -> bool:
    return not isinstance(v, str) or re.match(QUANTITY_PATTERN, v) is not None


def _check_quantity(v: int | str) -> int | str:
    if not is_quantity(v):
        raise ValueError(f"{v!r} is not a Kubernetes quantity")
    return v


IntOrString = Annotated[Union[int, str], Field(json_schema_extra={"x-kubernetes-int-or-string": True})]
# A Kubernetes quantity (2Gi, 500m, 4): every field of this type is checked by the one validator above.
Quantity = Annotated[IntOrString, AfterValidator(_check_quantity)]
IntOrPercent = IntOrString
FreeObject = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]


def section(cls: type) -> Any:
    """An optional sub-object that always exists after defaulting (CRD `default: {}` so nested defaults apply)."""
    return Field(default_factory=cls, json_schema_extra={"default": {}})


class _Model(BaseModel):
    # strict: like the API server, no "yes" for a boolean or "2" for an integer
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class ModelCache(_Model):
    """Where hf:// models are downloaded to (and the engine's other caches live)."""

    size: Quantity | None = Field(default=None, description="cache size: the emptyDir's sizeLimit and the pod's "
                                  "ephemeral-storage request, or the storage the operator's claim requests; "
                                  "defaults to resources.cacheSize")
    claim_name: str | None = Field(default=None, min_length=1, max_length=253,
                                   description="an existing PersistentVolumeClaim (ReadWriteMany for several pods) "
                                               "mounted at /cache by every pod: the model is downloaded once")
    persistent: bool = Field(default=False, description="the operator creates the cache claim(s) (needs size): "
                             "ReadWriteMany -> one claim <name>-model-cache shared by every pod; ReadWriteOnce -> "
                             "one claim per pod of a multi-pod group (volumeClaimTemplates)")
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"



class ModelSource(_Model):
    uri: str = Field(
        default=DEMO_URI, pattern=URI_PATTERN,
        description="hf://org/name (hub id, resolved through HF_HOME), pvc://claim/path (a PersistentVolumeClaim "
                    "mounted read-only at /models), oci://registry/repo:tag (an OCI image of model files mounted "
                    "read-only at /models as an image volume: Kubernetes >= 1.31 with the ImageVolume feature), "
                    "file:///path (a path inside the engine image) or demo:// (the "
                    "demo model baked into the engine image, SmolLM2-135M-Instruct; the default). With runtime shoal "
                    "its config.json's `architectures` must be one the engine serves: "
                    + ", ".join(SUPPORTED_ARCHITECTURES) + ".",
    )
    revision: str | None = Field(default=None, max_length=255, description="hub revision (hf:// only)")
    served_name: str | None = Field(
        default=None, min_length=1, max_length=255,
        description="name clients put in `model`; defaults to the hub id for hf://, else the resource's name",
    )
    chat_template: str | None = Field(
        default=None, max_length=262144,
        description="Jinja chat template text for models without one (mounted from a ConfigMap)",
    )
    cache: ModelCache = section(ModelCache)


def engine_option(name: str, *, default: Any = None, **limits: Any) -> Any:
    """A spec.engine field that sets EngineConfig's field `name`: its description is the engine flag's help, and
    render/ passes it as that flag (flags.to_args). `default` None leaves the engine's own default."""
    flag = flags.flag_of(EngineConfig.model_fields[name])
    assert flag is not None, f"EngineConfig.{name} is not a shoal-engine flag"
    return Field(default=default, description=f"{flag.help} ({flags.flag_name(EngineConfig, name)})", **limits)


class PoolerOptions(_Model):
    """How /v1/embeddings pools (the engine's --pooler-config); unset fields keep the model's own choice."""

    pooling_type: PoolingType | None = Field(default=None,
                                             description=PoolerConfig.model_fields["pooling_type"].description)
    normalize: bool | None = Field(default=None, description=PoolerConfig.model_fields["normalize"].description)


class MultiModalLimitOptions(_Model):
    """The most items of each modality one prompt may carry (the engine's --limit-mm-per-prompt)."""

    image: int | None = Field(default=None, ge=0, le=1024,
                              description=MultiModalLimits.model_fields["image"].description)


class EngineOptions(_Model):
    """Options of the engine (shoal-engine serve flags); unset ones keep the engine's defaults."""

    # Every field but the last two is the EngineConfig field of the same name (ENGINE_FLAG_FIELDS), rendered as
    # its flag in this order; a new engine option for the spec is one line here.

    tensor_parallel_size: int = engine_option("tensor_parallel_size", default=1, ge=1, le=256)
    pipeline_parallel_size: int = engine_option("pipeline_parallel_size", default=1, ge=1, le=64)
    dtype: Dtype = engine_option("dtype", default="auto")
    max_model_len: int | None = engine_option("max_model_len", ge=1, le=16777216)
    max_num_seqs: int | None = engine_option("max_num_seqs", ge=1, le=65536)
    max_num_batched_tokens: int | None = engine_option("max_num_batched_tokens", ge=1, le=16777216)
    gpu_memory_utilization: float | None = engine_option("gpu_memory_utilization", gt=0.0, le=1.0)
    enable_prefix_caching: bool = engine_option("enable_prefix_caching", default=True)
    kv_offloading_size: float | None = engine_option("kv_offloading_size", gt=0.0, le=1048576.0)
    kv_offloading_backend: Literal["native"] | None = engine_option("kv_offloading_backend")
    kv_offloading_disk_path: str | None = engine_option("kv_offloading_disk_path", min_length=1, max_length=4096,
                                                        pattern=r"^/")
    kv_offloading_disk_size: float | None = engine_option("kv_offloading_disk_size", gt=0.0, le=1048576.0)
    attention_backend: AttentionBackend = engine_option("attention_backend", default="auto")
    enforce_eager: bool = engine_option("enforce_eager", default=False)
    quantization: Literal["int8", "int4", "fp8"] | None = engine_option("quantization")
    kv_cache_dtype: Literal["auto", "fp8"] | None = engine_option("kv_cache_dtype")
    enable_lora: bool = engine_option("enable_lora", default=False)
    max_loras: int | None = engine_option("max_loras", ge=1, le=1024)
    max_lora_rank: int | None = engine_option("max_lora_rank", ge=1, le=4096)
    max_cpu_loras: int | None = engine_option("max_cpu_loras", ge=1, le=65536)
    scheduling_policy: Literal["fcfs", "priority"] | None = engine_option("scheduling_policy")
    enable_sleep_mode: bool = engine_option("enable_sleep_mode", default=False)
    runner: Runner | None = engine_option("runner")
    pooler_config: PoolerOptions | None = engine_option("pooler_config")
    limit_mm_per_prompt: MultiModalLimitOptions | None = engine_option("limit_mm_per_prompt")
    allowed_media_domains: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = engine_option(
        "allowed_media_domains", min_length=1, max_length=256)
    media_fetch_timeout: float | None = engine_option("media_fetch_timeout", gt=0.0, le=600.0)
    media_fetch_max_bytes: int | None = engine_option("media_fetch_max_bytes", ge=1, le=1073741824)
    media_fetch_allow_private_addresses: bool = engine_option("media_fetch_allow_private_addresses", default=False)
    max_image_pixels: int | None = engine_option("max_image_pixels", ge=1, le=1073741824)
    shutdown_timeout_seconds: int = Field(
        default=900, ge=0, le=21600,
        description="drain budget on SIGTERM (--shutdown-timeout): a replica removed by a scale-down, a rollout or "
                    "an eviction finishes its in-flight requests (long generations, streams) within it and exits "
                    "as soon as they are done; the pod's grace period is set above it. An engine that fails its "
                    "liveness or startup probe is stopped after probes.failureGracePeriodSeconds instead",
    )
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128, description="appended to `shoal-engine serve`; may not repeat "
                                                          "flags the operator sets")


# The spec.engine fields that are engine flags, in rendering order.
ENGINE_FLAG_FIELDS = runtimes.flag_fields(EngineOptions)


class Resources(_Model):
    gpus_per_pod: int | None = Field(
        default=None, ge=0, le=64,
        description="GPUs per pod; defaults to tensor×pipeline capped by the operator's GPUs-per-node. "
                    "0 runs on CPU. A replica spans ceil(tensor×pipeline / gpusPerPod) pods.",
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253,
                              pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")
    cpu: Quantity | None = Field(default=None, description="CPU request per pod")
    memory: Quantity | None = Field(default=None, description="memory request and limit per pod")
    shm_size: Quantity = Field(default="2Gi", description="size limit of the in-memory /dev/shm")
    cache_size: Quantity | None = Field(default=None, description="size of the model cache (see model.cache.size, "
                                        "which wins)")
    # values checked with the keys in semantic_errors, so the error names the resource: extra[rdma/hca]
    extra: dict[str, IntOrString] = Field(
        default_factory=dict, description="more extended resources per pod, requested and limited (e.g. "
                                          "rdma/hca_shared_devices_a: 1)")
    tensor_parallel_across_pods: bool = Field(
        default=False,
        description="allow a tensor-parallel group to span pods (nodes): slow without NVLink-class networking, so "
                    "refused unless set. By default every pod holds whole tensor-parallel groups.",
    )


class Scheduling(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeObject] = Field(default_factory=list)
    affinity: FreeObject | None = None
    priority_class_name: str | None = Field(default=None, max_length=253)
    topology_spread_constraints: list[FreeObject] = Field(default_factory=list, max_length=32)
    scheduler_name: str | None = Field(default=None, min_length=1, max_length=253,
                                       description="e.g. a gang scheduler (Volcano) or a batch scheduler")
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253,
                                           description="e.g. `nvidia` on k3s/RKE2, where it is not the default")


class PodOptions(_Model):
    labels: dict[str, str] = Field(default_factory=dict, description="extra labels of the engine pods (e.g. a "
                                   "Kueue queue); the operator's own labels cannot be overridden")
    annotations: dict[str, str] = Field(default_factory=dict, description="extra annotations of the engine pods "
                                        "(e.g. Multus networks, sidecar opt-outs)")
    service_account_name: str | None = Field(default=None, min_length=1, max_length=253)
    automount_service_account_token: bool = Field(default=False, description="engines never call the API; "
                                                  "set it for a service account whose token a sidecar needs")
    template: FreeObject | None = Field(
        default=None,
        description="strategic-merge overlay on the rendered pod template ({metadata, spec}), applied last: "
                    "containers, volumes, env... merge by name, `$patch: delete` removes an item, null a field",
    )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(default="api-key", min_length=1, max_length=253)


class NetworkPolicyOptions(_Model):
    enabled: bool = True
    allow_from: list[FreeObject] = Field(
        default_factory=list,
        description="NetworkPolicyPeers allowed to reach the API (the gateway, or the engines without it); empty "
                    "means only pods of the same namespace, so an ingress controller or a mesh gateway elsewhere "
                    "(Envoy Gateway, Istio ingress, ingress-nginx) must be listed here, e.g. a namespaceSelector",
    )
    metrics_from: list[FreeObject] = Field(
        default_factory=list,
        description="NetworkPolicyPeers of the Prometheus that scrapes /metrics of engines and gateways (served on "
                    "the HTTP port), besides the operator's namespace and its --metrics-namespace settings",
    )


class Security(_Model):
    api_key_secret_ref: SecretKeyRef | None = Field(default=None, description="Secret holding the API key")
    capabilities: list[Literal["IPC_LOCK", "SYS_RESOURCE"]] = Field(
        default_factory=list, description="Linux capabilities added to the engine container (all others are "
                                          "dropped); IPC_LOCK lets RDMA (GPUDirect, InfiniBand) pin memory")
    network_policy: NetworkPolicyOptions = section(NetworkPolicyOptions)


class Probes(_Model):
    startup_timeout_seconds: int = Field(default=contract.DEFAULT_STARTUP_TIMEOUT_SECONDS, ge=30, le=86400,
                                         description="model load budget before the pod is restarted")
    download_timeout_seconds: int = Field(
        default=21600, ge=60, le=604800,
        description="budget of the hf:// model download (init container), counted apart from the rollout's "
                    "progress deadline: a slow, healthy download is progress (reason ModelDownloading); beyond "
                    "the budget the reason is ModelDownloadTimeout")
    failure_grace_period_seconds: int = Field(
        default=30, ge=1, le=3600,
        description="grace period of an engine killed for failing its liveness or startup probe (a hung or "
                    "crash-looping engine), apart from the long drain of engine.shutdownTimeoutSeconds")


class Rollout(_Model):
    max_unavailable: IntOrPercent = 0
    max_surge: IntOrPercent = 1

    @field_validator("max_unavailable", "max_surge")
    @classmethod
    def _int_or_percent(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0 or isinstance(v, str) and not re.match(r"^[0-9]{1,3}%$", v):
            raise ValueError(f"{v!r} must be a non-negative integer or a percentage such as '25%'")
        return v


class Autoscaling(_Model):
    """When set, the operator sizes the fleet to the load: the replica count is the autoscaler's
    (status.autoscaling.desiredReplicas) and spec.replicas is only where a new fleet starts, so re-applying a
    manifest (kubectl apply, a GitOps sync) never fights the autoscaler."""

    min_replicas: int = Field(default=1, ge=0, le=1000,
                              description="fewest replicas; 0 lets the fleet scale to zero when idle")
    max_replicas: int = Field(ge=1, le=1000, description="most replicas (a cap on GPUs spent)")
    target_in_flight_per_replica: int = Field(
        default=16, ge=1, le=65536,
        description="requests running or waiting per replica to aim for (engines' num_requests_running + "
                    "num_requests_waiting, plus requests the gateway holds); about maxNumSeqs/2 keeps batches "
                    "full without queueing")
    target_kv_cache_usage: float = Field(
        default=0.8, gt=0.0, le=1.0, alias="targetKVCacheUsage",
        description="KV-cache usage per replica to aim for (long contexts fill the cache before the batch)")
    target_waiting_prefill_tokens_per_replica: int | None = Field(
        default=None, ge=1, le=16777216,
        description="prompt tokens waiting for prefill per replica to aim for (off when unset)")
    scale_up_stabilization_seconds: int = Field(
        default=5, ge=0, le=3600,
        description="scale up to the lowest recommendation of this window (short spikes add nothing)")
    scale_down_stabilization_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="scale down to the highest recommendation of this window; replicas still starting count "
                    "as capacity, so a long window is not needed to stop overshoot while models load")
    scale_to_zero_after_seconds: int = Field(
        default=300, ge=0, le=86400,
        description="with minReplicas 0: the last replica goes after this long without any request")
    # Where the load is read, and who acts on the decision (operator/autoscaler.py; docs/autoscaling.md).
    load_source: Literal["auto", "engines", "gateways"] = Field(
        default="auto",
        description="where the load is read: engines (each engine's /metrics), gateways (the gateways' view: "
                    "their in-flight counts and the engine load they poll — for engines the operator cannot "
                    "reach, e.g. behind Istio STRICT mTLS) or auto (engines, and the gateways' view of any "
                    "engine that does not answer)")
    autoscaler_class: Literal["shoal", "external"] = Field(
        default="shoal",
        description="shoal: the operator sets the replica count; external: it only observes and exports its "
                    "inputs and recommendation as shoal:autoscaler_* metrics, and spec.replicas (the scale "
                    "subresource) is left to an HPA or KEDA ScaledObject")
    # What "zero" means (docs/autoscaling.md, "Scale to zero by sleeping").
    scale_to_zero: Literal["delete", "sleep"] = Field(
        default="delete",
        description="with minReplicas 0, what happens to idle replicas at zero: delete (the pods go; a request "
                    "starts a new pod, which loads the model) or sleep (the pods stay, their engines asleep "
                    "through POST /sleep, so waking one costs seconds, not a pod start; needs "
                    "engine.enableSleepMode)")
    sleep_level: Literal[1, 2] = Field(
        default=1,
        description="with scaleToZero sleep: 1 frees the KV cache and keeps the weights in host memory (fastest "
                    "wake-up), 2 frees the weights too (they are read again from the model files on wake-up)")


class Adapter(_Model):
    """A LoRA adapter of the base model: a PEFT directory (adapter_config.json, adapter_model.safetensors)."""

    # the API server checks each item with the same rule as the validator below
    model_config = ConfigDict(**_Model.model_config, json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.revision) || self.uri.startsWith('hf://')", "fieldPath": ".revision",
         "message": "revision applies to hf:// adapters only", "reason": "FieldValueInvalid"}]})

    name: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                      description="the name clients put in `model` to use the adapter")
    uri: str = Field(
        pattern=ADAPTER_URI_PATTERN, max_length=4096,
        description="hf://org/name (fetched by each pod into its cache volume), pvc://claim/path (the claim is "
                    "mounted read-only at /adapters/<claim>: adapters on a claim already mounted are added without "
                    "any restart) or file:///path (a path inside the engine image)")
    revision: str | None = Field(default=None, min_length=1, max_length=255,
                                 description="hub revision (hf:// only): a branch, tag or commit; a commit pins the "
                                             "weights every replica serves")
    priority: int | None = Field(
        default=None, ge=-2147483648, le=2147483647,
        description="this adapter's requests' priority in the shared gateway (as spec.priority, which it "
                    "overrides for the adapter; unset: spec.priority)")

    @model_validator(mode="after")
    def _revision_for_hub_only(self) -> "Adapter":
        if self.revision is not None and not self.uri.startswith("hf://"):
            raise ValueError("revision applies to hf:// adapters only")
        return self


class GatewayResources(_Model):
    cpu: Quantity | None = Field(default="250m", description="CPU request per gateway pod")
    memory: Quantity | None = Field(default=None, description="memory request and limit per gateway pod; unset: "
                                                              "sized from the gateway's bounds (maxBufferedBytes, "
                                                              "maxPending, its prefix index), so it cannot be "
                                                              "OOM-killed")


class GatewayBatches(_Model):
    """OpenAI's Files and Batches API at this service's gateway (shoal-gateway --batch-dir), its state on a volume."""

    enabled: bool = Field(default=False, description="serve /v1/files and /v1/batches at the gateway, keeping "
                          "uploads, batches and their results on a PersistentVolumeClaim <name>-gateway-batches (or "
                          "existingClaim) that every gateway pod mounts: a restarted or rolled gateway resumes its "
                          "batches, neither losing nor repeating a finished request")
    size: Quantity = Field(default="10Gi", description="the claim's storage request (input files, results)")
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany", description="every gateway pod mounts the claim, on whichever node it runs: "
        "ReadWriteOnce (one node) is refused while several gateway pods run (gateway.replicas is at least 2)")
    existing_claim: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^[a-z0-9]"
                                       r"([-a-z0-9.]*[a-z0-9])?$", description="mount this PersistentVolumeClaim "
                                       "(ReadWriteMany) instead of the operator's; it is never created or deleted "
                                       "by the operator")


def _gateway_option_fields() -> dict[str, Any]:
    """spec.gateway's shoal-gateway options, from their one declaration on GatewayConfig (gateway/options.py)."""
    fields: dict[str, Any] = {}
    for declared, spec in gateway_options.spec_fields(GatewayConfig):
        annotation: Any = Literal[declared.option.choices] if declared.option.choices else spec.type
        fields[spec.name] = (annotation, Field(default=gateway_options.spec_default(declared), ge=spec.ge,
                                               le=spec.le, description=spec.description))
    return fields


GatewayOptions = create_model(
    "GatewayOptions", __base__=_Model, __module__=__name__,
    enabled=(bool, Field(
        default=True,
        description="run shoal-gateway (prefix-cache and load-aware routing) in front of the engines; the Service "
                    "<name> points at it, and engines accept HTTP only from it. false: <name> points at the "
                    "engines directly (plain L4 balancing).")),
    replicas=(int, Field(default=2, ge=2, le=100, description="gateway pods (at least 2, for availability)")),
    image=(str | None, Field(default=None, max_length=1024,
                             description="gateway image; the operator's default (the small image without torch)")),
    resources=(GatewayResources, section(GatewayResources)),
    batches=(GatewayBatches, section(GatewayBatches)),
    **_gateway_option_fields(),
)


# ------------------------------------------------------------------- Gateway API Inference Extension (InferencePool)
# Users whose Gateway (Envoy Gateway, Istio, GKE...) already runs the inference extension's endpoint picker get an
# InferencePool (inference.networking.k8s.io/v1) selecting the serving engine pods, and optionally an HTTPRoute
# (gateway.networking.k8s.io/v1) sending this model's requests to it. Field limits follow the published CRDs
# (gateway-api-inference-extension v1.6.0, gateway-api v1.6.1); render/ says which objects they become.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class EndpointPicker(_Model):
    name: str = Field(min_length=1, max_length=253, description="the endpoint picker's Service (in this namespace)")
    port: int = Field(default=9002, ge=1, le=65535, description="its ext-proc (gRPC) port; 9002 is the EPP's")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose", description="what the Gateway does when the picker does not answer: FailClose "
                                         "refuses the request, FailOpen sends it to any engine of the pool")


class GatewayParentRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="the Gateway")
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=DNS_LABEL,
                                  description="the Gateway's namespace (default: this one; another needs the "
                                              "Gateway's listeners to allow routes from here)")
    section_name: str | None = Field(default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                                     description="a listener of the Gateway")


class HTTPRouteOptions(_Model):
    parent_refs: list[GatewayParentRef] = Field(min_length=1, max_length=32,
                                                description="the Gateways that serve the route")
    hostnames: list[Annotated[str, Field(min_length=1, max_length=253,
                                         pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*"
                                                 r"[a-z0-9])?)*$")]] = Field(default_factory=list, max_length=16)
    match_model_header: bool = Field(
        default=True,
        description="route only requests whose X-Gateway-Model-Name header is this service's model (the header "
                    "the extension's body-based router sets from the request's `model`), so several "
                    "InferenceServices share one Gateway; false: every request of the route's hostnames")


class InferencePoolOptions(_Model):
    """Render an InferencePool of the serving engine pods (and optionally an HTTPRoute to it) for a Gateway that runs
    the Gateway API Inference Extension: its endpoint picker then chooses the engine for each request, reading the
    engines' vllm:* metrics (queue, KV usage, LoRA, cache shape), which Shoal's engine exports. Shoal's own gateway
    keeps running for clients of the Service <name>."""

    endpoint_picker: EndpointPicker
    http_route: HTTPRouteOptions | None = Field(default=None, description="also route the Gateway's requests for "
                                                                         "this model to the pool")


class TracingHeadersRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="the Secret, in the InferenceService's namespace")
    key: str = Field(default="headers", min_length=1, max_length=253,
                     description="its entry: OTLP headers as key=value pairs, comma-separated, e.g. "
                                 "`authorization=Bearer%20<token>` (OTEL_EXPORTER_OTLP_TRACES_HEADERS)")


class Tracing(_Model):
    """OpenTelemetry traces of this service's requests (gateway -> engine, one trace per request), exported over
    OTLP/HTTP: rendered as the standard OTEL_* variables into the engine and the gateway containers."""

    endpoint: str = Field(
        pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$", max_length=2048,
        description="the collector's OTLP/HTTP base URL, e.g. http://otel-collector.observability:4318: spans go to "
                    "<endpoint>/v1/traces (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    sampling_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0,
        description="share of new traces recorded; a request arriving with a W3C traceparent follows its caller's "
                    "decision (OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG)")
    headers_secret_ref: TracingHeadersRef | None = Field(
        default=None, description="a Secret entry with the headers the collector wants (e.g. its API key)")
# ------------------------------------------------------------------------------------------------- canary revisions
def _optional_copy(model: type[BaseModel], name: str) -> type[BaseModel]:
    """`model` with every field optional and without a default: a field set overrides the stable revision's, an
    unset one inherits it (a default would be filled in by the API server and override it silently)."""
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        copied = copy.copy(info)
        copied.default, copied.default_factory = None, None
        fields[field_name] = (info.annotation | None, copied)
    return create_model(name, __base__=_Model, __module__=__name__, __doc__=model.__doc__, **fields)


CanaryEngineOptions = _optional_copy(EngineOptions, "CanaryEngineOptions")


class CanaryModel(_Model):
    """The canary's model; unset fields are the stable revision's. The served name must stay the same."""

    uri: str | None = Field(default=None, pattern=URI_PATTERN, description="as spec.model.uri")
    revision: str | None = Field(default=None, max_length=255,
                                 description="hub revision (hf:// only); unset: the stable revision's when the uri is "
                                             "the same, none for another uri")
    served_name: str | None = Field(default=None, min_length=1, max_length=255,
                                    description="must equal the stable revision's served name (clients keep their "
                                                "`model`): set it when the canary's hf:// id differs")


class CanaryRollback(_Model):
    """The canary's SLO, judged by the operator on what the gateways measure per revision over a sliding window:
    breaking it rolls the canary back (traffic 0, its Deployment removed; condition CanaryRolledBack)."""

    max_error_rate: float = Field(default=0.05, ge=0.0, le=1.0,
                                  description="most failed canary requests allowed (5xx, an engine that failed or "
                                              "timed out), as a fraction of the canary's requests in the window")
    max_p95_first_byte_seconds: float | None = Field(
        default=None, gt=0.0, le=3600.0,
        description="most p95 time to the first byte of the canary's answers (time to first token for streams, the "
                    "whole answer otherwise); unset: not judged")
    window_seconds: int = Field(default=60, ge=5, le=3600, description="the sliding window the figures cover")
    min_requests: int = Field(default=20, ge=1, le=1000000,
                              description="fewer canary requests than this in the window are not judged (the error "
                                          "budget: at most about this many failed requests reach clients)")


class Canary(_Model):
    """A second revision of the service next to the stable one (spec.model, image, engine), receiving
    trafficPercent of the requests through the gateway, sticky per conversation. Promote with `promote: true`
    (the operator moves the canary's fields into the stable spec and removes spec.canary); remove spec.canary to
    drop it."""

    model: CanaryModel | None = Field(default=None, description="the canary's model (unset: the stable one)")
    image: str | None = Field(default=None, max_length=1024, description="the canary's engine image")
    engine: CanaryEngineOptions | None = Field(  # type: ignore[valid-type]
        default=None, description="engine options that differ from spec.engine (the others are inherited)")
    replicas: int = Field(default=1, ge=1, le=1000, description="canary replicas (not autoscaled)")
    traffic_percent: int = Field(default=10, ge=0, le=100,
                                 description="share of conversations sent to the canary (0-100); each "
                                             "conversation keeps its revision")
    rollback: CanaryRollback = section(CanaryRollback)
    promote: bool = Field(default=False, description="true: the canary becomes the stable revision (its fields "
                                                     "written into spec.model/image/engine, spec.canary removed)")


class PrefillAutoscaling(_Model):
    """The prefill role's autoscaling, on its own signal: the prompt tokens waiting on the prefill engines (their
    shoal:num_waiting_prefill_tokens) and the requests they carry. Field names and semantics are spec.autoscaling's
    (docs/autoscaling.md); the decode replicas are decided apart. minReplicas 0 is safe: with no prefill engine the
    decode engines prefill themselves, and the prompt tokens waiting on them scale the role back up from zero."""

    min_replicas: int = Field(default=1, ge=0, le=1000,
                              description="fewest prefill engines; 0 lets the role go when idle (the decode engines "
                                          "prefill themselves meanwhile)")
    max_replicas: int = Field(ge=1, le=1000, description="most prefill engines")
    target_waiting_prefill_tokens_per_replica: int = Field(
        default=8192, ge=1, le=16777216,
        description="prompt tokens waiting for prefill per prefill engine to aim for (the engines' "
                    "shoal:num_waiting_prefill_tokens; a few times engine.maxNumBatchedTokens keeps each busy "
                    "without queueing long)")
    target_in_flight_per_replica: int = Field(
        default=16, ge=1, le=65536,
        description="requests running or waiting per prefill engine to aim for (num_requests_running + "
                    "num_requests_waiting)")
    scale_up_stabilization_seconds: int = Field(
        default=5, ge=0, le=3600,
        description="scale up to the lowest recommendation of this window (short spikes add nothing)")
    scale_down_stabilization_seconds: int = Field(
        default=60, ge=0, le=3600, description="scale down to the highest recommendation of this window")
    scale_to_zero_after_seconds: int = Field(
        default=300, ge=0, le=86400,
        description="with minReplicas 0: the last prefill engine goes after this long without any prefill")


class Prefill(_Model):
    """Prefill/decode disaggregation: a prefill role of engines of the same model and engine options that prefill
    each request for the decode engines (the replicas above), which pull the prompt's KV from them
    (docs/engine.md, Prefill/decode disaggregation). The gateway sends every completion's prefill to the
    least-loaded prefill engine; with none usable, the decode engine prefills itself."""

    replicas: int = Field(default=1, ge=1, le=1000,
                          description="prefill engines; with prefill.autoscaling only the starting point (the "
                                      "autoscaler owns the count, in status.prefill.desiredReplicas)")
    cpu: Quantity | None = Field(default=None, description="CPU request per prefill pod (unset: resources.cpu)")
    memory: Quantity | None = Field(default=None, description="memory request and limit per prefill pod (unset: "
                                                              "resources.memory)")
    autoscaling: PrefillAutoscaling | None = Field(
        default=None, description="size the prefill role to the prefill engines' own load, apart from the decode "
                                  "replicas (spec.autoscaling); the operator then owns the prefill count "
                                  "(status.prefill.desiredReplicas)")


class InferenceServiceSpec(_Model):
    runtime: Literal["shoal", "vllm", "sglang"] = Field(  # operator/runtimes.py describes each
        default="shoal",
        description="the inference engine in the pods: shoal (the bundled engine), vllm (vLLM's OpenAI server) or "
                    "sglang (rendered, untested end to end). The image defaults per runtime (spec.image overrides); "
                    "gateway, autoscaler, status and NetworkPolicies work the same for each. A spec field the "
                    "runtime cannot honour is InvalidSpec naming the runtime.")
    model: ModelSource = section(ModelSource)
    replicas: int = Field(default=1, ge=0, le=1000,
                          description="replicas to run; with spec.autoscaling only the starting point (the autoscaler "
                                      "owns the count, in status.autoscaling.desiredReplicas)")
    engine: EngineOptions = section(EngineOptions)
    resources: Resources = section(Resources)
    image: str | None = Field(default=None, max_length=1024, description="engine image; the operator's default")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[Annotated[str, Field(max_length=253)]] = Field(default_factory=list)
    scheduling: Scheduling = section(Scheduling)
    env: list[FreeObject] = Field(default_factory=list, description="extra EnvVars for the engine container")
    security: Security = section(Security)
    probes: Probes = section(Probes)
    rollout: Rollout = section(Rollout)
    pod: PodOptions = section(PodOptions)
    autoscaling: Autoscaling | None = Field(
        default=None, description="size the fleet to the load (min 0 allowed); the operator then owns the replica "
                                  "count (status.autoscaling.desiredReplicas) and spec.replicas is only the start")
    gateway: GatewayOptions = section(GatewayOptions)
    adapters: list[Adapter] = Field(
        default_factory=list, max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="LoRA adapters served next to the base model (needs engine.enableLora): each pod fetches and "
                    "loads them into its running engine, and unloads the ones removed, without a restart; "
                    "status.adapters counts, per adapter, the serving replicas where it is loaded, failed or pending")
    # Priority and the inference extension (shared gateway, docs/gateway.md; InferencePool, render/)
    priority: int = Field(
        default=0, ge=-2147483648, le=2147483647,
        description="how important this model's requests are where they compete for a Shoal gateway's capacity: "
                    "higher first; under saturation the lowest is shed first (429). Not rendered for the Gateway "
                    "API Inference Extension (no InferenceObjective: give one of your own). Sent to engines that schedule by priority "
                    "(engine.schedulingPolicy: priority). Applies to the model and to its adapters without a priority of "
                    "their own (spec.adapters[].priority)")
    tracing: Tracing | None = Field(
        default=None, description="export OpenTelemetry traces of the requests from the gateway and the engines "
                                  "(off when unset; the pods' own OTEL_* env, spec.env, overrides what this renders)")
    inference_pool: InferencePoolOptions | None = Field(
        default=None, description="render an InferencePool (Gateway API Inference Extension) for a Gateway that "
                                  "already runs the extension's endpoint picker; off by default")
    canary: Canary | None = Field(
        default=None, description="a canary revision (model, image, engine options) receiving a share of the "
                                  "traffic, rolled back automatically when it breaks its SLO (docs/api.md)")
    prefill: Prefill | None = Field(
        default=None, description="prefill/decode disaggregation: a role of prefill engines whose KV the decode "
                                  "engines pull (runtime shoal, through the gateway); off when unset")

    @model_validator(mode="after")
    def _cross_field(self) -> "InferenceServiceSpec":
        for rule in CROSS_FIELD_RULES:
            if not rule.check(self):
                detail = f" ({rule.explain(self)})" if rule.explain else ""
                raise ValueError(f"spec.{rule.field_path.lstrip('.')}: {rule.message}{detail}")
        return self

    # Derived values (one place for the arithmetic render/ and status use)
    def cache_size(self) -> int | str | None:
        return self.model.cache.size if self.model.cache.size is not None else self.resources.cache_size

    @property
    def world_size(self) -> int:
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size

    def gpus_per_pod(self, max_gpus_per_node: int = 8) -> int:
        """Explicit, else the whole job in one pod when a node has the GPUs, else as many whole tensor-parallel
        groups (pipeline stages) per pod as fit a node; tensor groups split across pods only when allowed."""
        if self.resources.gpus_per_pod is not None:
            return self.resources.gpus_per_pod
        world, tp, pp = self.world_size, self.engine.tensor_parallel_size, self.engine.pipeline_parallel_size
        if world <= max_gpus_per_node:
            return world
        if tp <= max_gpus_per_node:
            return tp * max(k for k in range(1, pp + 1) if pp % k == 0 and tp * k <= max_gpus_per_node)
        return max(d for d in range(1, max_gpus_per_node + 1) if tp % d == 0)  # refused unless allowed

    def pods_per_replica(self, max_gpus_per_node: int = 8) -> int:
        gpus = self.gpus_per_pod(max_gpus_per_node)
        return 1 if gpus == 0 else math.ceil(self.world_size / gpus)


Status = Literal["True", "False", "Unknown"]


class Condition(_Model):
    type: str
    status: Status
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0)


class AutoscalingInputs(_Model):
    in_flight: int = Field(default=0, ge=0, description="requests running or waiting on engines, plus held")
    held: int = Field(default=0, ge=0, description="requests the gateway holds while no replica is ready")
    kv_cache_usage: float = Field(default=0.0, ge=0.0, description="sum over serving replicas (1.0 = one full)")
    waiting_prefill_tokens: int = Field(default=0, ge=0)
    ready: int = Field(default=0, ge=0)
    starting: int = Field(default=0, ge=0)


class AutoscalingStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    current_replicas: int | None = Field(default=None, ge=0, description="replicas running when the decision ran")
    desired_replicas: int | None = Field(default=None, ge=0, description="the replica count the operator runs: the "
                                                                         "autoscaler's, not spec.replicas")
    needed_replicas: int | None = Field(default=None, ge=0, description="what the load needed, before "
                                                                        "stabilization and limits")
    reason: str | None = Field(default=None, max_length=256)
    message: str | None = Field(default=None, max_length=4096)
    last_decision_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    last_scale_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    inputs: AutoscalingInputs | None = None
    sleeping_replicas: int | None = Field(default=None, ge=0,
                                          description="with scaleToZero sleep: replicas whose engine is asleep "
                                                      "(pods kept, not Ready; the gateway wakes one on a request)")


class AdapterError(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    pod: str
    state: Literal["Failed", "Unknown"]
    message: str | None = Field(default=None, max_length=256)


class AdapterStatus(_Model):
    """One adapter across the fleet, in counts: its size does not grow with the number of pods (etcd refuses a
    status write above its request limit, ~1.5 MiB, and 256 adapters x 64 pods listed one by one exceeded it)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    name: str
    uri: str
    revision: str | None = None
    ready_replicas: int = Field(default=0, ge=0, description="serving replicas where the adapter is loaded")
    failed_replicas: int = Field(default=0, ge=0, description="serving replicas where its load failed")
    pending_replicas: int = Field(default=0, ge=0, description="serving replicas still downloading or loading it, "
                                                               "or whose sidecar does not answer")
    errors: list[AdapterError] = Field(
        default_factory=list, max_length=2,
        description="a few examples of the pods where it failed or is unknown, with the reason (the condition "
                    "AdaptersReady and AdapterLoadFailed Events say more)")


class CachedModel(_Model):
    """One entry of the model cache, as the newest pod's download found the cache."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    entry: str = Field(max_length=600)
    size_bytes: int | None = Field(default=None, ge=0)
    last_used: str | None = Field(default=None, max_length=32, description="when a pod last started on it (UTC)")
    leases: int | None = Field(default=None, ge=0, description="pods holding a live lease on it (never evicted)")


class ModelCacheStatus(_Model):
    """The model's entry in the model cache and what the cache holds, as the newest pod's download init container
    reported them (bounded: ten entries at most, however many pods or models there are)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    entry: str = Field(max_length=600, description="the entry's folder under /cache/shoal/models (model@revision)")
    commit: str | None = Field(default=None, max_length=64, description="the hub commit it holds")
    size_bytes: int | None = Field(default=None, ge=0)
    verified: Literal["hub", "manifest"] | None = Field(
        default=None, description="hub: every file matched the hub's checksum when downloaded; manifest: checked "
                                  "against the sha256 manifest written at download")
    fetched: bool | None = Field(default=None, description="that pod downloaded it (false: found in the cache)")
    pods: int | None = Field(default=None, ge=0, description="live pods whose download reported this entry")
    evicted: list[Annotated[str, Field(max_length=600)]] | None = Field(
        default=None, max_length=5, description="entries that download evicted (least recently used, unleased)")
    volume: str | None = Field(default=None, max_length=400, description="where the cache is: the claim every pod "
                                                                         "shares, or each pod's own volume")
    cached_entries: int | None = Field(default=None, ge=0, description="entries in the cache")
    used_bytes: int | None = Field(default=None, ge=0, description="bytes the cache's entries hold")
    cap_bytes: int | None = Field(default=None, ge=0, description="the size cap eviction keeps it under")
    cached: list[CachedModel] | None = Field(default=None, max_length=10,
                                             description="the most recently used entries, newest first")


class RevisionFigures(_Model):
    """One revision's requests through the gateways over the canary's window (spec.canary.rollback.windowSeconds)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    requests: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0, description="answered 5xx, or the engine failed or timed out")
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    p95_first_byte_seconds: float | None = Field(default=None, ge=0.0)


class CanaryRollbackStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    revision: str = Field(description="the canary revision that was rolled back (status.canary.revision)")
    reason: str = Field(max_length=256)
    message: str = Field(default="", max_length=4096)
    time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})


class CanaryStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    revision: str | None = Field(default=None, description="hash of the canary's model, image and engine options")
    traffic_percent: int | None = Field(default=None, ge=0, le=100,
                                        description="the share the gateways send it now (0 once rolled back)")
    split: str | None = Field(default=None, description="stable/canary percentages, for `kubectl get`")
    replicas: int | None = Field(default=None, ge=0)
    ready_replicas: int | None = Field(default=None, ge=0)
    stable: RevisionFigures | None = Field(default=None, description="the stable revision's figures")
    canary: RevisionFigures | None = Field(default=None, description="the canary revision's figures")
    figures_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    rollback: CanaryRollbackStatus | None = Field(default=None, description="set when the operator rolled this "
                                                                            "revision back (it then gets no traffic)")


class PrefillStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    replicas: int | None = Field(default=None, ge=0)
    ready_replicas: int | None = Field(default=None, ge=0, description="prefill engines Ready (with none, the "
                                                                       "decode engines prefill themselves)")
    # the autoscaler's (spec.prefill.autoscaling), next to the reconciler's counts above
    desired_replicas: int | None = Field(default=None, ge=0, description="the prefill count the operator runs: the "
                                                                         "autoscaler's, not spec.prefill.replicas")
    needed_replicas: int | None = Field(default=None, ge=0, description="what the prefill load needed, before "
                                                                        "stabilization and limits")
    reason: str | None = Field(default=None, max_length=256)
    message: str | None = Field(default=None, max_length=4096)
    last_decision_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    last_scale_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    inputs: AutoscalingInputs | None = Field(default=None, description="the prefill engines' load (waiting prefill "
                                             "tokens include the decode engines' while no prefill engine is ready)")


class InferenceServiceStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=False)

    phase: Literal["Pending", "Loading", "Ready", "Degraded", "Failed"] | None = None
    replicas: int | None = Field(default=None, ge=0)
    ready_replicas: int | None = Field(default=None, ge=0)
    ready: str | None = Field(default=None, description="ready/desired replicas, for `kubectl get`")
    updated_replicas: int | None = Field(default=None, ge=0)
    selector: str | None = Field(default=None, description="label selector of the serving pods (scale subresource)")
    url: str | None = Field(default=None, description="in-cluster URL of the gateway Service")
    served_model_name: str | None = None
    engine_image: str | None = Field(
        default=None, max_length=1024,
        description="the operator's default engine image this service runs (without spec.image): pinned, so a new "
                    "operator version does not roll every fleet at once; moved to the new default under the "
                    "operator's --max-concurrent-upgrades budget, or at once with the annotation "
                    "serving.shoal.dev/upgrade-engine-image")
    observed_generation: int | None = Field(default=None, ge=0)
    autoscaling: AutoscalingStatus | None = Field(default=None, description="the autoscaler's last decision")
    adapters: list[AdapterStatus] | None = Field(default=None, description="spec.adapters as the pods report them")
    model_cache: ModelCacheStatus | None = Field(default=None, description="what the model cache holds for this "
                                                 "service's hf:// model")
    prefill: PrefillStatus | None = Field(default=None, description="the prefill role (spec.prefill)")
    canary: CanaryStatus | None = Field(default=None, description="the canary revision (spec.canary): its share, "
                                                                  "replicas and both revisions' figures")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


# ------------------------------------------------------------------------------------------------ cross-field rules
@dataclass(frozen=True)
class CrossFieldRule:
    """One rule, said twice: CEL for the API server (evaluated on `spec`), Python for the operator."""

    cel: str
    message: str
    field_path: str  # relative to spec, as the CRD's fieldPath (".resources.gpusPerPod")
    check: Callable[[InferenceServiceSpec], bool]
    explain: Callable[[InferenceServiceSpec], str] | None = None  # the numbers, in the operator's message


def _zero(v: int | str) -> bool:
    return v == 0 or v == "0%"


CROSS_FIELD_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        cel="!has(self.engine) || (has(self.engine.kvOffloadingDiskPath) == has(self.engine.kvOffloadingDiskSize) && "
            "(!has(self.engine.kvOffloadingDiskPath) || has(self.engine.kvOffloadingSize)))",
        message="kvOffloadingDiskPath and kvOffloadingDiskSize go together, and the disk tier needs "
                "kvOffloadingSize (it takes what the host-memory tier lets go)",
        field_path=".engine.kvOffloadingDiskPath",
        check=lambda s: (s.engine.kv_offloading_disk_path is None) == (s.engine.kv_offloading_disk_size is None)
        and (s.engine.kv_offloading_disk_path is None or s.engine.kv_offloading_size is not None),
    ),
    CrossFieldRule(
        cel="!has(self.engine) || !has(self.engine.kvOffloadingSize) || !has(self.engine.enablePrefixCaching) || "
            "self.engine.enablePrefixCaching",
        message="kvOffloadingSize keeps evicted prefix-cache blocks: it needs enablePrefixCaching",
        field_path=".engine.kvOffloadingSize",
        check=lambda s: s.engine.kv_offloading_size is None or s.engine.enable_prefix_caching,
    ),
    CrossFieldRule(
        cel="!has(self.resources) || !has(self.resources.gpusPerPod) || self.resources.gpusPerPod == 0 || "
            "((has(self.engine) && has(self.engine.tensorParallelSize) ? self.engine.tensorParallelSize : 1) * "
            "(has(self.engine) && has(self.engine.pipelineParallelSize) ? self.engine.pipelineParallelSize : 1)) "
            "% self.resources.gpusPerPod == 0",
        message="gpusPerPod must divide engine.tensorParallelSize × engine.pipelineParallelSize "
                "(every pod of a replica holds the same number of ranks)",
        field_path=".resources.gpusPerPod",
        check=lambda s: not s.resources.gpus_per_pod or s.world_size % s.resources.gpus_per_pod == 0,
        explain=lambda s: (f"tensor {s.engine.tensor_parallel_size} × pipeline {s.engine.pipeline_parallel_size} = "
                           f"{s.world_size} ranks on pods of {s.resources.gpus_per_pod} GPUs would leave "
                           f"{-s.world_size % s.resources.gpus_per_pod} requested GPUs idle"),
    ),
    CrossFieldRule(
        cel="!has(self.engine) || !has(self.engine.maxNumBatchedTokens) || !has(self.engine.maxNumSeqs) || "
            "self.engine.maxNumBatchedTokens >= self.engine.maxNumSeqs",
        message="maxNumBatchedTokens must be at least maxNumSeqs (each running sequence needs a token per step)",
        field_path=".engine.maxNumBatchedTokens",
        check=lambda s: s.engine.max_num_batched_tokens is None or s.engine.max_num_seqs is None
        or s.engine.max_num_batched_tokens >= s.engine.max_num_seqs,
    ),
    CrossFieldRule(
        cel="!has(self.rollout) || !has(self.rollout.maxUnavailable) || !has(self.rollout.maxSurge) || "
            "!((self.rollout.maxUnavailable == 0 || self.rollout.maxUnavailable == '0%') && "
            "(self.rollout.maxSurge == 0 || self.rollout.maxSurge == '0%'))",
        message="maxUnavailable and maxSurge cannot both be zero (a rollout could never make progress)",
        field_path=".rollout.maxSurge",
        check=lambda s: not (_zero(s.rollout.max_unavailable) and _zero(s.rollout.max_surge)),
    ),
    CrossFieldRule(
        cel="!has(self.model) || !has(self.model.revision) || self.model.uri.startsWith('hf://')",
        message="revision applies to hf:// models only",
        field_path=".model.revision",
        check=lambda s: s.model.revision is None or s.model.uri.startswith("hf://"),
    ),
    CrossFieldRule(
        cel="!has(self.adapters) || size(self.adapters) == 0 || (has(self.engine) && has(self.engine.enableLora) && "
            "self.engine.enableLora)",
        message="adapters need engine.enableLora: true (the engine reserves its adapter slots when it starts, so "
                "turning LoRA on restarts the engines once; adapters added later load without a restart)",
        field_path=".engine.enableLora",
        check=lambda s: not s.adapters or s.engine.enable_lora,
    ),
    CrossFieldRule(
        cel="!has(self.prefill) || !has(self.runtime) || self.runtime == 'shoal'",
        message="prefill (prefill/decode disaggregation) runs Shoal engines only: the KV moves between them over "
                "Shoal's own transport",
        field_path=".runtime",
        check=lambda s: s.prefill is None or s.runtime == "shoal",
    ),
    CrossFieldRule(
        cel="!has(self.prefill) || !has(self.gateway) || !has(self.gateway.enabled) || self.gateway.enabled",
        message="prefill needs the gateway: it sends each request's prefill to a prefill engine and its decode to "
                "a decode engine",
        field_path=".prefill",
        check=lambda s: s.prefill is None or s.gateway.enabled,
    ),
    CrossFieldRule(
        cel="!has(self.prefill) || !has(self.engine) || !has(self.engine.enablePrefixCaching) || "
            "self.engine.enablePrefixCaching",
        message="prefill moves a prompt's KV blocks by their prefix-cache hashes: it needs engine.enablePrefixCaching",
        field_path=".engine.enablePrefixCaching",
        check=lambda s: s.prefill is None or s.engine.enable_prefix_caching,
    ),
    CrossFieldRule(
        cel="!has(self.prefill) || !has(self.prefill.autoscaling) || !has(self.prefill.autoscaling.minReplicas) || "
            "self.prefill.autoscaling.minReplicas <= self.prefill.autoscaling.maxReplicas",
        message="prefill.autoscaling.minReplicas must not exceed prefill.autoscaling.maxReplicas",
        field_path=".prefill.autoscaling.minReplicas",
        check=lambda s: s.prefill is None or s.prefill.autoscaling is None
        or s.prefill.autoscaling.min_replicas <= s.prefill.autoscaling.max_replicas,
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || "
            "self.autoscaling.minReplicas <= self.autoscaling.maxReplicas",
        message="minReplicas must not exceed maxReplicas",
        field_path=".autoscaling.minReplicas",
        check=lambda s: s.autoscaling is None or s.autoscaling.min_replicas <= s.autoscaling.max_replicas,
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || self.autoscaling.minReplicas > 0 || "
            "!has(self.gateway) || !has(self.gateway.enabled) || self.gateway.enabled",
        message="autoscaling.minReplicas 0 needs the gateway: it holds requests while no replica runs and wakes "
                "the autoscaler; without it nothing would ever scale the fleet back up from zero",
        field_path=".gateway.enabled",
        check=lambda s: s.autoscaling is None or s.autoscaling.min_replicas > 0 or s.gateway.enabled,
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.scaleToZero) || self.autoscaling.scaleToZero != "
            "'sleep' || (has(self.engine) && has(self.engine.enableSleepMode) && self.engine.enableSleepMode)",
        message="autoscaling.scaleToZero sleep needs engine.enableSleepMode: true (the engines must offer "
                "POST /sleep and /wake_up to be parked asleep instead of deleted)",
        field_path=".autoscaling.scaleToZero",
        check=lambda s: s.autoscaling is None or s.autoscaling.scale_to_zero != "sleep" or s.engine.enable_sleep_mode,
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.scaleToZero) || self.autoscaling.scaleToZero != "
            "'sleep' || (has(self.autoscaling.minReplicas) && self.autoscaling.minReplicas == 0)",
        message="autoscaling.scaleToZero sleep applies when the fleet scales to zero: set minReplicas: 0",
        field_path=".autoscaling.scaleToZero",
        check=lambda s: s.autoscaling is None or s.autoscaling.scale_to_zero != "sleep"
        or s.autoscaling.min_replicas == 0,
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.scaleToZero) || self.autoscaling.scaleToZero != "
            "'sleep' || !has(self.autoscaling.loadSource) || self.autoscaling.loadSource != 'gateways'",
        message="autoscaling.scaleToZero sleep needs the operator to reach the engines (it puts them to sleep and "
                "reads /is_sleeping): loadSource gateways says it cannot; use auto or engines",
        field_path=".autoscaling.scaleToZero",
        check=lambda s: s.autoscaling is None or s.autoscaling.scale_to_zero != "sleep"
        or s.autoscaling.load_source != "gateways",
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.scaleToZero) || self.autoscaling.scaleToZero != "
            "'sleep' || !has(self.security) || !has(self.security.apiKeySecretRef)",
        message="autoscaling.scaleToZero sleep cannot be used with security.apiKeySecretRef yet: the operator "
                "puts engines to sleep through their admin routes and holds no engine key; use scaleToZero "
                "delete, or rely on the gateway's client keys and the engines' NetworkPolicy",
        field_path=".autoscaling.scaleToZero",
        check=lambda s: s.autoscaling is None or s.autoscaling.scale_to_zero != "sleep"
        or s.security.api_key_secret_ref is None,
    ),
    CrossFieldRule(
        cel="!has(self.gateway) || !has(self.gateway.batches) || !has(self.gateway.batches.accessMode) || "
            "self.gateway.batches.accessMode != 'ReadWriteOnce' || has(self.gateway.batches.existingClaim) || "
            "(has(self.gateway.replicas) && self.gateway.replicas == 1)",
        message="accessMode ReadWriteOnce attaches the batch volume to one node, but every gateway pod mounts it "
                "and they spread across nodes; use a ReadWriteMany storage class (NFS, CephFS, EFS, Filestore, ...) "
                "or an existingClaim",
        field_path=".gateway.batches.accessMode",
        check=lambda s: s.gateway.batches.access_mode != "ReadWriteOnce" or bool(s.gateway.batches.existing_claim)
        or s.gateway.replicas == 1,
        explain=lambda s: f"gateway.replicas is {s.gateway.replicas}",
    ),
    CrossFieldRule(
        cel="!has(self.autoscaling) || !has(self.autoscaling.loadSource) || "
            "self.autoscaling.loadSource != 'gateways' || !has(self.gateway) || !has(self.gateway.enabled) || "
            "self.gateway.enabled",
        message="autoscaling.loadSource gateways needs the gateway (gateway.enabled)",
        field_path=".autoscaling.loadSource",
        check=lambda s: s.autoscaling is None or s.autoscaling.load_source != "gateways" or s.gateway.enabled,
    ),
)


# ------------------------------------------------------------------------------------------------------ validation


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = "spec"
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before", "function-plain") or str(part).startswith(
                ("function-", "int", "str", "literal[", "union[", "lax-or-strict")):
            continue
        else:
            path += f".{part}"
    return path


def parse_spec(spec: Any) -> InferenceServiceSpec:
    """Validate a spec dict (camelCase) into the model; raise SpecError naming the first offending field."""
    try:
        return InferenceServiceSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith("spec.") and ":" in msg:  # cross-field rule: the path is in the message
            field, _, message = msg.partition(": ")
            raise SpecError(field, message) from None
        loc = tuple(err["loc"])
        # pydantic reports union members (int|str) as extra loc parts; keep only field names and indexes
        names = [p for p in loc if isinstance(p, int) or (isinstance(p, str) and p[:1].islower() and "[" not in p
                                                            and p not in ("int", "str", "function-after"))]
        raise SpecError(_loc_to_path(tuple(names)), msg) from None


def semantic_errors(name: str, spec: InferenceServiceSpec, *, max_gpus_per_node: int) -> list[SpecError]:
    """Rules the schema cannot express (they depend on the operator's settings or on derived names)."""
    errors: list[SpecError] = []
    gpus = spec.gpus_per_pod(max_gpus_per_node)
    tp = spec.engine.tensor_parallel_size
    if gpus > max_gpus_per_node:
        errors.append(SpecError("spec.resources.gpusPerPod",
                                f"{gpus} GPUs per pod exceeds the {max_gpus_per_node} GPUs a node has "
                                f"(operator setting --max-gpus-per-node)"))
    elif gpus > 0 and gpus % tp and not spec.resources.tensor_parallel_across_pods:
        explicit = spec.resources.gpus_per_pod is not None
        errors.append(SpecError(
            "spec.resources.gpusPerPod" if explicit else "spec.engine.tensorParallelSize",
            (f"{gpus} GPUs per pod split each tensor-parallel group of {tp} across "
             f"{math.ceil(tp / gpus) if gpus < tp else 2} pods; use a multiple of {tp} GPUs per pod"
             if explicit else
             f"a tensor-parallel group of {tp} GPUs does not fit one node ({max_gpus_per_node} GPUs, operator "
             f"setting --max-gpus-per-node); lower tensorParallelSize (raise pipelineParallelSize)")
            + ", or set spec.resources.tensorParallelAcrossPods: true to accept tensor parallelism across nodes"))
    pods = spec.pods_per_replica(max_gpus_per_node)
    # Longest child name: <name>-g<index>-<ordinal> for pods of a multi-pod group (a rollout may surge groups up
    # to index replicas+maxSurge-1), <name>-<hash>-<hash> else.
    most = max(spec.replicas, spec.autoscaling.max_replicas if spec.autoscaling else 0)
    surge = spec.rollout.max_surge
    surge = surge if isinstance(surge, int) else math.ceil(int(surge.rstrip("%")) * most / 100)
    limit = 63 - len(f"-g{max(most + surge - 1, 0)}-{pods - 1}") if pods > 1 else 47
    if len(name) > limit:
        errors.append(SpecError("metadata.name", f"must be at most {limit} characters for this topology "
                                                 "(child and pod names are derived from it)"))
    errors += runtimes.spec_errors(spec, pods)
    if spec.prefill is not None and pods > 1:
        errors.append(SpecError("spec.prefill", f"prefill engines run in one pod each: this topology spreads a "
                                                f"replica over {pods} pods"))
    if spec.prefill is not None and len(name) > 39:
        errors.append(SpecError("metadata.name", "must be at most 39 characters with spec.prefill (the prefill "
                                                 "Deployment's pods are named <name>-prefill-<hash>-<hash>)"))
    if spec.gateway.max_buffered_bytes < spec.gateway.max_body_bytes:
        errors.append(SpecError("spec.gateway.maxBufferedBytes",
                                f"{spec.gateway.max_buffered_bytes} is below maxBodyBytes "
                                f"({spec.gateway.max_body_bytes}): the largest body could never be admitted"))
    for i, arg in enumerate(spec.engine.extra_args):
        if arg.split("=", 1)[0] == "--device" and gpus == 0:
            errors.append(SpecError(f"spec.engine.extraArgs[{i}]", "--device is set by the operator: pods without "
                                    "GPUs (resources.gpusPerPod: 0) run on CPU"))
    cache = spec.model.cache
    if cache.claim_name and cache.persistent:
        errors.append(SpecError("spec.model.cache.claimName", "use either an existing claim or persistent: true"))
    if cache.persistent and spec.cache_size() is None:
        errors.append(SpecError("spec.model.cache.size", "a persistent cache needs a size (the claim's request)"))
    if cache.persistent and cache.access_mode == "ReadWriteOnce" and pods == 1:
        errors.append(SpecError("spec.model.cache.accessMode",
                                "ReadWriteOnce claims are per pod, which only multi-pod groups (StatefulSets) have; "
                                "use ReadWriteMany (one claim shared by every pod) or claimName"))
    for key in spec.pod.labels:
        if key.startswith(RESERVED_LABEL_PREFIXES):
            errors.append(SpecError(f"spec.pod.labels[{key}]", "is set by the operator (selectors depend on it)"))
    for key, value in spec.resources.extra.items():
        if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$", key):
            errors.append(SpecError(f"spec.resources.extra[{key}]", "must be an extended resource name "
                                                                   "(domain/name, e.g. rdma/hca)"))
        elif not is_quantity(value):
            errors.append(SpecError(f"spec.resources.extra[{key}]", f"{value!r} is not a Kubernetes quantity"))
    for i, env in enumerate(spec.env):
        if not isinstance(env.get("name"), str) or not env.get("name"):
            errors.append(SpecError(f"spec.env[{i}].name", "every env entry needs a name"))
    if spec.model.uri.startswith("oci://"):
        ref = spec.model.uri[len("oci://"):]
        if not re.match(OCI_REFERENCE, ref) or not re.search(r"(:[^/]+|@sha256:[a-f0-9]{64})$", ref):
            errors.append(SpecError("spec.model.uri", f"{ref!r} is not a full OCI image reference: "
                                                      "oci://registry.example.com/repo/name:tag (or @sha256:<digest>)"))
    if spec.model.uri.startswith("pvc://") and not spec.model.uri[len("pvc://"):].split("/", 1)[0]:
        errors.append(SpecError("spec.model.uri", "pvc:// needs a claim name: pvc://claim/path"))
    errors += _adapter_errors(name, spec, pods)
    errors += _sleep_errors(spec, pods)
    if spec.canary is not None and not errors:
        errors += canary_errors(name, spec, max_gpus_per_node=max_gpus_per_node)
    return errors


def _sleep_errors(spec: InferenceServiceSpec, pods: int) -> list[SpecError]:
    """scaleToZero sleep needs a runtime whose sleep mode the fleet can drive (readiness fails while asleep, so
    the gateway routes nothing there, and /is_sleeping says so), and single-pod replicas (the autoscaler parks
    and wakes a replica through its one engine endpoint)."""
    a = spec.autoscaling
    if a is None or a.scale_to_zero != "sleep":
        return []
    rt = runtimes.of(spec)
    if not rt.sleep_parking:
        return [SpecError("spec.autoscaling.scaleToZero",
                          f"runtime {rt.name} has no sleep mode the fleet can park replicas in (its readiness does "
                          "not fail while asleep, so requests would reach a sleeping engine); use runtime shoal or "
                          "scaleToZero delete")]
    if pods > 1:
        return [SpecError("spec.autoscaling.scaleToZero",
                          f"replicas of {pods} pods cannot be parked asleep yet; use scaleToZero delete")]
    return []


def _canary_wire(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The canary's whole spec on the wire: the stable spec with the canary's fields over it, without a canary."""
    c = spec.canary
    assert c is not None
    wire = spec.model_dump(by_alias=True, mode="json", exclude={"canary"})
    if c.model is not None:
        model = wire["model"]
        if c.model.uri is not None and c.model.uri != spec.model.uri:
            model["uri"], model["revision"] = c.model.uri, None
        if c.model.revision is not None:
            model["revision"] = c.model.revision
        if c.model.served_name is not None:
            model["servedName"] = c.model.served_name
    if c.image is not None:
        wire["image"] = c.image
    if c.engine is not None:
        wire["engine"].update(c.engine.model_dump(by_alias=True, mode="json", exclude_none=True))
    wire["replicas"] = c.replicas
    wire["autoscaling"] = None  # the canary's replica count is its own, never the autoscaler's
    return wire


def canary_spec(spec: InferenceServiceSpec) -> InferenceServiceSpec:
    """The canary revision as a whole spec (what render/ renders its Deployment from); raises SpecError naming
    the spec.canary field at fault."""
    try:
        return parse_spec(_canary_wire(spec))
    except SpecError as e:
        raise SpecError("spec.canary." + e.field.removeprefix("spec."), e.message) from None


def canary_errors(name: str, spec: InferenceServiceSpec, *, max_gpus_per_node: int) -> list[SpecError]:
    """The canary must be a revision of the same service: the same served name, single-pod replicas."""
    try:
        canary = canary_spec(spec)
    except SpecError as e:
        return [e]
    served, canary_served = served_model_name(name, spec), served_model_name(name, canary)
    if canary_served != served:
        return [SpecError("spec.canary.model.servedName",
                          f"the canary would serve `{canary_served}` but this service serves `{served}`: clients "
                          f"keep one model name across revisions; set spec.canary.model.servedName: {served}")]
    if not spec.gateway.enabled:
        return [SpecError("spec.canary", "a canary needs the gateway (spec.gateway.enabled): it splits the traffic "
                                         "between the revisions")]
    if spec.pods_per_replica(max_gpus_per_node) > 1 or canary.pods_per_replica(max_gpus_per_node) > 1:
        return [SpecError("spec.canary", "canary revisions need single-pod replicas (a Deployment); this service's "
                                         "replicas span several pods")]
    errors = semantic_errors(name, canary, max_gpus_per_node=max_gpus_per_node)
    return [SpecError("spec.canary." + e.field.removeprefix("spec."), e.message) for e in errors]


def _adapter_errors(name: str, spec: InferenceServiceSpec, pods: int) -> list[SpecError]:
    errors = []
    served = served_model_name(name, spec)
    seen: set[str] = set()
    shared_cache = spec.model.cache.claim_name or (spec.model.cache.persistent
                                                   and spec.model.cache.access_mode == "ReadWriteMany")
    for i, adapter in enumerate(spec.adapters):
        path = f"spec.adapters[{i}]"
        if adapter.name in seen:
            errors.append(SpecError(f"{path}.name", f"{adapter.name!r} is declared twice"))
        seen.add(adapter.name)
        if adapter.name == served:
            errors.append(SpecError(f"{path}.name", f"{adapter.name!r} is the base model's served name"))
        if adapter.uri.startswith("hf://") and pods > 1 and not shared_cache:
            errors.append(SpecError(f"{path}.uri", f"hf:// adapters of a replica of {pods} pods need a shared "
                                                   "model cache (model.cache.claimName, or persistent with "
                                                   "ReadWriteMany): rank 0 fetches the adapter and every rank "
                                                   "reads it"))
    return errors


def validate(name: str, spec: Any, *, max_gpus_per_node: int = 8) -> InferenceServiceSpec:
    """Everything the operator checks before touching children: schema, CEL-equivalents, semantics."""
    parsed = parse_spec(spec)
    errors = semantic_errors(name, parsed, max_gpus_per_node=max_gpus_per_node)
    if errors:
        raise errors[0]
    return parsed


def running_replicas(spec: InferenceServiceSpec, status: dict[str, Any] | None) -> int:
    """The replica count the operator runs. Without autoscaling, or with autoscalerClass external: spec.replicas
    (the user's, or an HPA's or KEDA's through the scale subresource). With it: the autoscaler's last decision (status.autoscaling.desiredReplicas; spec.replicas
    before the first one), within minReplicas..maxReplicas — never spec.replicas again, which a re-applied manifest
    resets."""
    a = spec.autoscaling
    if a is None or a.autoscaler_class == "external":  # an HPA or KEDA writes spec.replicas
        return spec.replicas
    decided = ((status or {}).get("autoscaling") or {}).get("desiredReplicas")
    count = decided if isinstance(decided, int) and not isinstance(decided, bool) else spec.replicas
    return min(max(count, a.min_replicas), a.max_replicas)


def running_prefill_replicas(spec: InferenceServiceSpec, status: dict[str, Any] | None) -> int:
    """The prefill engines the operator runs (spec.prefill): spec.prefill.replicas, or with prefill.autoscaling the
    autoscaler's last decision (status.prefill.desiredReplicas; spec.prefill.replicas before the first one), within
    its minReplicas..maxReplicas. 0 without spec.prefill."""
    p = spec.prefill
    if p is None:
        return 0
    if p.autoscaling is None:
        return p.replicas
    decided = ((status or {}).get("prefill") or {}).get("desiredReplicas")
    count = decided if isinstance(decided, int) and not isinstance(decided, bool) else p.replicas
    return min(max(count, p.autoscaling.min_replicas), p.autoscaling.max_replicas)


def served_model_name(name: str, spec: InferenceServiceSpec) -> str:
    return contract.served_model_name(name, spec.model.uri, spec.model.served_name)
