"""spec.adapters (operator/adapters.py): the ConfigMap and sidecar the pods get, a pod template that does not move
when the list does, validation, and status.adapters from the sidecars' reports."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from shoal.operator import adapters, api, render
from shoal.operator.render import Settings

K8S_VERSION = kubernetes_validate.latest_version()
SETTINGS = Settings(engine_image="registry.test/shoal-engine:1", operator_namespace="shoal-system")
LORA = {"engine": {"enableLora": True, "maxLoras": 4, "maxLoraRank": 64}}
TWO_PODS = {"enableLora": True, "tensorParallelSize": 8, "pipelineParallelSize": 2}  # 8 GPUs a pod, 2 pods
ADAPTERS = [{"name": "sql", "uri": "hf://org/sql-lora", "revision": "0a1b2c3"},
            {"name": "chat", "uri": "pvc://adapters/chat/v2"},
            {"name": "local", "uri": "pvc://models/loras/local"},
            {"name": "baked", "uri": "file:///opt/loras/baked"}]


def isvc(spec: dict, name: str = "llm") -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec}


def kids(spec: dict) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(isvc(spec), SETTINGS)}


def spec_with(adapter_list: list[dict], **more) -> dict:
    return {"model": {"uri": "pvc://models/llama-8b"}, **LORA, "adapters": adapter_list, **more}


def test_adapters_render_a_configmap_a_sidecar_and_valid_children():
    spec = spec_with(ADAPTERS, security={"apiKeySecretRef": {"name": "key", "key": "k"}})
    children = kids(spec)
    for obj in children.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    listed = json.loads(children[("ConfigMap", "llm-adapters")]["data"]["adapters.json"])["adapters"]
    assert listed == [{"name": "sql", "source": "hf://org/sql-lora@0a1b2c3"},
                      {"name": "chat", "source": "/adapters/adapters/chat/v2"},
                      {"name": "local", "source": "/models/loras/local"},  # on the model's own claim
                      {"name": "baked", "source": "/opt/loras/baked"}]
    pod = children[("Deployment", "llm")]["spec"]["template"]["spec"]
    engine, sidecar = pod["containers"]
    assert "--enable-lora" in engine["args"] and engine["args"][engine["args"].index("--max-loras") + 1] == "4"
    assert {"name": "adapter-claim-0", "mountPath": "/adapters/adapters", "readOnly": True} in engine["volumeMounts"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters"] == {"name": "adapters", "configMap": {"name": "llm-adapters"}}
    assert volumes["adapter-claim-0"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    assert sidecar["name"] == "adapter-sync" and sidecar["command"] == ["shoal-podtools"] and sidecar["args"][0] == "sync-adapters"
    assert sidecar["ports"] == [{"name": "adapter-sync", "containerPort": 8001, "protocol": "TCP"}]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "adapter-sync"}
    env = {e["name"]: e for e in sidecar["env"]}
    # the engine's key Secret, mounted: it sends the newest key, read at each call (a rotation needs no restart)
    assert env["SHOAL_API_KEY_FILE"] == {"name": "SHOAL_API_KEY_FILE", "value": "/etc/shoal/api-keys/keys"}
    assert "SHOAL_API_KEY" not in env
    assert "HF_HUB_OFFLINE" not in env  # it fetches hf:// adapters; the engine stays offline
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {"/cache", "/tmp", "/etc/shoal/adapters",
                                                                 "/etc/shoal/api-keys"}
    # the operator reads the sidecars' /status: its namespace is admitted on their port
    rules = children[("NetworkPolicy", "llm")]["spec"]["ingress"]
    assert {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shoal-system"}}}],
            "ports": [{"port": 8001, "protocol": "TCP"}]} in rules


def test_changing_the_adapter_list_leaves_the_pod_template_alone():
    """The list lives in the ConfigMap only: adding, removing or re-pinning adapters on claims the pods already
    mount changes no template (so no pod restarts); only a new claim has to be mounted."""
    def hashes(adapter_list):
        k = kids(spec_with(adapter_list))
        return (k[("Deployment", "llm")]["metadata"]["annotations"][render.A_SPEC_HASH],
                k[("ConfigMap", "llm-adapters")]["data"]["adapters.json"])

    base = hashes(ADAPTERS)
    edited = hashes([{**ADAPTERS[0], "revision": "ffff"}, ADAPTERS[1], {"name": "new", "uri": "hf://org/new"}])
    assert edited[0] == base[0] and edited[1] != base[1]
    assert hashes([])[0] == hashes([{"name": "a", "uri": "file:///a"}])[0]
    assert hashes(ADAPTERS + [{"name": "other", "uri": "pvc://other-claim/x"}])[0] != base[0]


def test_no_lora_renders_nothing_new():
    children = kids({"model": {"uri": "pvc://models/llama-8b"}})
    assert ("ConfigMap", "llm-adapters") not in children
    pod = children[("Deployment", "llm")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine"]
    assert "--enable-lora" not in pod["containers"][0]["args"]


def test_vllm_runtime_loads_adapters_through_its_runtime_endpoints():
    children = kids(spec_with(ADAPTERS[:2], runtime="vllm"))
    pod = children[("Deployment", "llm")]["spec"]["template"]["spec"]
    engine, sidecar = pod["containers"]
    assert engine["command"] == ["vllm", "serve"] and "--enable-lora" in engine["args"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in engine["env"]
    assert sidecar["image"] == SETTINGS.fleet_image != engine["image"]  # the sidecar comes from the operator image


@pytest.mark.parametrize("spec,field,words", [
    ({**LORA, "runtime": "sglang", "model": {"uri": "hf://o/m"}, "adapters": ADAPTERS[:1]}, "spec.adapters",
     "runtime sglang"),
    ({**LORA, "adapters": [{"name": "a", "uri": "pvc://c/a", "revision": "x"}]}, "spec.adapters[0]",
     "hf:// adapters only"),
    ({**LORA, "model": {"uri": "hf://o/m", "servedName": "m"}, "adapters": [{"name": "m", "uri": "file:///m"}]},
     "spec.adapters[0].name", "base model's served name"),
    ({**LORA, "adapters": [{"name": "a", "uri": "file:///a"}, {"name": "a", "uri": "file:///b"}]},
     "spec.adapters[1].name", "declared twice"),
    ({"engine": TWO_PODS, "model": {"uri": "hf://o/m"}, "adapters": ADAPTERS[:1]}, "spec.adapters[0].uri",
     "shared model cache"),
])
def test_bad_adapter_specs_are_invalid_and_say_why(spec, field, words):
    with pytest.raises(api.SpecError) as e:
        api.validate("llm", spec)
    assert e.value.field == field and words in e.value.message, e.value


def test_multi_pod_replicas_with_a_shared_cache_take_hub_adapters():
    spec = {"engine": TWO_PODS, "model": {"uri": "hf://o/m", "cache": {"claimName": "shared"}},
            "adapters": ADAPTERS[:1]}
    groups = [o for o in render.render(isvc(spec), SETTINGS) if o["kind"] == "StatefulSet"]
    assert groups and all(len(g["spec"]["template"]["spec"]["containers"]) == 2 for g in groups)


# ------------------------------------------------------------------------------------------------------- status
def parsed(adapter_list):
    return api.validate("llm", spec_with(adapter_list))


def report(spec, states: dict[str, tuple[str, str | None]], config: str | None = None) -> dict:
    return {"config": config or adapters.digest(adapters.config(spec)), "engine": "ready",
            "adapters": [{"name": n, "source": adapters.source(spec, a), "state": s, "message": m}
                         for a in spec.adapters for n, (s, m) in states.items() if a.name == n]}


def test_status_per_replica_and_condition():
    spec = parsed(ADAPTERS[:2])
    per_pod = {
        "llm-a": adapters.replica_states(spec, report(spec, {"sql": ("Loaded", None), "chat": ("Loaded", None)}), None),
        "llm-b": adapters.replica_states(spec, report(spec, {"sql": ("Loaded", None),
                                                             "chat": ("Failed", "400: rank 128 above 64")}), None),
    }
    entries, (ok, reason, message) = adapters.summarize(spec, per_pod)
    assert [(e["name"], e["readyReplicas"], e["failedReplicas"]) for e in entries] == [("sql", 2, 0), ("chat", 1, 1)]
    assert entries[0]["revision"] == "0a1b2c3"
    assert entries[1]["errors"] == [{"pod": "llm-b", "state": "Failed", "message": "400: rank 128 above 64"}]
    assert (ok, reason) == (False, "AdapterLoadFailed") and "chat on llm-b: 400: rank 128" in message
    api.InferenceServiceStatus.model_validate({"adapters": entries})  # what the CRD's status schema says

    per_pod["llm-b"] = adapters.replica_states(spec, report(spec, {"sql": ("Loaded", None),
                                                                   "chat": ("Loaded", None)}), None)
    assert adapters.summarize(spec, per_pod)[1][:2] == (True, "AllAdaptersLoaded")


def test_a_pod_that_has_not_seen_the_new_list_is_pending():
    spec = parsed(ADAPTERS[:2])
    old = parsed(ADAPTERS[:1])
    states = adapters.replica_states(spec, report(old, {"sql": ("Loaded", None)}), None)
    assert states["sql"] == ("Loaded", None)  # same source: its state holds
    assert states["chat"][0] == "Pending" and "has not seen this adapter list" in states["chat"][1]
    unreachable = adapters.replica_states(spec, None, "its adapter-sync sidecar does not answer")
    assert unreachable["sql"] == ("Unknown", "its adapter-sync sidecar does not answer")
    assert adapters.summarize(spec, {"p": states})[1][1] == "AdaptersLoading"


def test_the_status_stays_small_whatever_the_fleet_size():
    """256 adapters x 64 pods, every load failed with a long reason: listed pod by pod that was ~6 MB, past etcd's
    request limit, and the status patch was refused (Ready froze). Counts and a few examples stay far below."""
    many = [{"name": f"team-adapter-{i:03}", "uri": f"hf://org/team-adapter-{i:03}"} for i in range(256)]
    spec = parsed(many)
    reason = "400: " + "the adapter's rank 128 is above the engine's --max-lora-rank 64; " * 20
    per_pod = {f"llm-7d9f8b6c5d-{i:05}": {a["name"]: ("Failed", reason) for a in many} for i in range(64)}
    entries, (ok, kind, message) = adapters.summarize(spec, per_pod)
    patch = json.dumps({"status": {"adapters": entries, "conditions": [{"type": "AdaptersReady", "message": message}]}})
    assert len(patch.encode()) < 256 * 1024, len(patch)
    assert entries[0]["failedReplicas"] == 64 and entries[0]["readyReplicas"] == 0
    assert len(entries[0]["errors"]) == adapters.MAX_EXAMPLES and entries[0]["errors"][0]["pod"] == "llm-7d9f8b6c5d-00000"
    assert (ok, kind) == (False, "AdapterLoadFailed") and "16384 failed" in message
    api.InferenceServiceStatus.model_validate({"adapters": entries})


def test_a_failure_is_one_event_per_adapter_and_reason_not_per_pod():
    reports = adapters.AdapterReports(trigger=lambda *_: None)
    failures = [("sql", f"llm-{i}", "400: bad rank") for i in range(64)]
    assert reports.new_failures(("ns", "llm"), failures) == [("sql", "llm-0", "400: bad rank")]
    assert reports.new_failures(("ns", "llm"), failures + [("sql", "llm-9", "500: busy")]) == [
        ("sql", "llm-9", "500: busy")]

def test_the_list_names_the_base_model_when_the_operator_knows_it():
    """The sidecar refuses adapters trained for another base model: it learns the service's model from the list
    (an hf:// model's hub id; a path model has none the operator could know)."""
    hub = api.validate("llm", spec_with(ADAPTERS[:1], model={"uri": "hf://meta-llama/Llama-3.1-8B"}))
    assert json.loads(adapters.config(hub))["baseModel"] == "meta-llama/Llama-3.1-8B"
    assert "baseModel" not in json.loads(adapters.config(parsed(ADAPTERS[:1])))


def test_only_a_pods_own_cache_has_its_unused_adapter_snapshots_deleted():
    """A sidecar deletes the hub snapshots its list no longer uses; in a cache other pods share (an existing claim,
    the shared ReadWriteMany claim) their lists may still use them, so there it keeps them."""
    def sidecar_args(cache):
        spec = spec_with(ADAPTERS[:1], model={"uri": "hf://org/base", "cache": cache})
        dep = kids(spec)[("Deployment", "llm")]
        (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == adapters.SIDECAR]
        return c["args"]
    assert "--keep-unused-snapshots" not in sidecar_args({})  # an emptyDir: the pod's own
    assert "--keep-unused-snapshots" in sidecar_args({"claimName": "shared-hf"})
    assert "--keep-unused-snapshots" in sidecar_args({"persistent": True, "size": "100Gi",
                                                      "accessMode": "ReadWriteMany"})


def test_a_pods_own_cache_is_bounded_and_the_sidecar_stays_below_the_bound():
    """With LoRA a pvc:// model's cache still holds hub adapters: it gets a size limit (not from the list, which
    must never roll pods), and the sidecar stops downloading at 90 % of it rather than have the pod evicted."""
    def pod(spec):
        dep = kids(spec)[("Deployment", "llm")]["spec"]["template"]["spec"]
        (c,) = [c for c in dep["containers"] if c["name"] == adapters.SIDECAR]
        (cache,) = [v for v in dep["volumes"] if v["name"] == "cache"]
        return cache, c["args"]
    cache, args = pod(spec_with(ADAPTERS[:1]))
    assert cache == {"name": "cache", "emptyDir": {"sizeLimit": "50Gi"}}
    assert args[args.index("--max-cache-bytes") + 1] == str(int(50 * 2**30 * 0.9))
    assert pod(spec_with(ADAPTERS))[0] == cache  # another list: the same template
    cache, args = pod(spec_with(ADAPTERS[:1], model={"uri": "pvc://models/llama-8b", "cache": {"size": "20Gi"}}))
    assert cache["emptyDir"] == {"sizeLimit": "20Gi"} and args[args.index("--max-cache-bytes") + 1] == str(
        int(20 * 2**30 * 0.9))
    assert "--max-cache-bytes" not in pod(spec_with(ADAPTERS[:1], model={"uri": "pvc://models/llama-8b",
                                                                         "cache": {"claimName": "shared"}}))[1]
