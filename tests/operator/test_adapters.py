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
    assert sidecar["name"] == "adapter-sync" and sidecar["args"][:2] == ["shoal-engine", "sync-adapters"] and "command" not in sidecar
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
    assert sidecar["image"] == SETTINGS.engine_image  # the sidecar comes from Shoal's image


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
    assert [(e["name"], e["readyReplicas"]) for e in entries] == [("sql", 2), ("chat", 1)]
    assert entries[0]["revision"] == "0a1b2c3"
    assert entries[1]["replicas"][1] == {"pod": "llm-b", "state": "Failed", "message": "400: rank 128 above 64"}
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


def test_a_big_fleet_lists_the_pods_that_need_attention():
    spec = parsed(ADAPTERS[:1])
    per_pod = {f"llm-{i:03}": {"sql": ("Failed", "boom") if i == 99 else ("Loaded", None)} for i in range(100)}
    (entry,), _ = adapters.summarize(spec, per_pod)
    assert entry["readyReplicas"] == 99 and len(entry["replicas"]) == adapters.MAX_LISTED
    assert entry["replicas"][0] == {"pod": "llm-099", "state": "Failed", "message": "boom"}
