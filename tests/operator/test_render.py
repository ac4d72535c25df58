"""render/: every topology and option, every object validated against the official Kubernetes schemas."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from shoal.operator import api, render
from shoal.operator.render import L_GROUP, L_ISVC, L_POD_INDEX, Settings

K8S_VERSION = kubernetes_validate.latest_version()  # the newest schemas the installed package ships
SETTINGS = Settings(engine_image="registry.test/shoal-engine:1", fleet_image="registry.test/shoal-operator:1",
                    operator_namespace="shoal-system")


def isvc(spec: dict | None = None, name: str = "llm", namespace: str = "team-a") -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": "0b9a5c1e-uid", "generation": 1},
            "spec": spec or {}}


def by_kind(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


TOPOLOGIES = {
    "cpu-demo": {"resources": {"gpusPerPod": 0, "cpu": 2, "memory": "4Gi"}},
    "single-gpu": {"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}},
    "tp4": {"model": {"uri": "pvc://models/llama-70b"}, "engine": {"tensorParallelSize": 4}, "replicas": 2},
    "tp8xpp2": {"model": {"uri": "hf://meta-llama/Llama-3.1-405B"}, "replicas": 2,
                "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}},
    "everything": {
        "model": {"uri": "file:///opt/models/m", "servedName": "m", "chatTemplate": "{{ messages }}"},
        "replicas": 3, "image": "my.registry/engine:2", "imagePullPolicy": "Always", "imagePullSecrets": ["pull"],
        "engine": {"tensorParallelSize": 2, "dtype": "bfloat16", "maxModelLen": 8192, "maxNumSeqs": 64,
                   "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "enablePrefixCaching": False,
                   "attentionBackend": "triton", "enforceEager": True, "shutdownTimeoutSeconds": 120,
                   "extraArgs": ["--seed", "7"]},
        "resources": {"gpusPerPod": 2, "gpuResource": "amd.com/gpu", "cpu": "16", "memory": "128Gi",
                      "shmSize": "16Gi", "cacheSize": "200Gi"},
        "scheduling": {"nodeSelector": {"gpu": "a100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                           "nodeSelectorTerms": [{"matchExpressions": [
                               {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                       "priorityClassName": "inference"},
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "HF_HUB_OFFLINE", "value": "0"}],
        "security": {"apiKeySecretRef": {"name": "llm-key", "key": "token"},
                     "networkPolicy": {"allowFrom": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}},
        "probes": {"startupTimeoutSeconds": 3600},
        "rollout": {"maxUnavailable": 1, "maxSurge": 0},
    },
    "no-netpol": {"security": {"networkPolicy": {"enabled": False}}, "replicas": 0},
    "lora-adapters": {"model": {"uri": "hf://org/m", "cache": {"claimName": "shared"}}, "replicas": 2,
                      "engine": {"enableLora": True, "maxLoras": 4, "tensorParallelSize": 8, "pipelineParallelSize": 2},
                      "security": {"apiKeySecretRef": {"name": "k"}},
                      "adapters": [{"name": "sql", "uri": "hf://org/sql", "revision": "abc"},
                                   {"name": "chat", "uri": "pvc://loras/chat"}]},
    "platform-knobs": {
        "model": {"uri": "hf://org/m"}, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
        "scheduling": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                      "whenUnsatisfiable": "ScheduleAnyway",
                                                      "labelSelector": {"matchLabels": {L_ISVC: "llm"}}}],
                       "schedulerName": "volcano", "runtimeClassName": "nvidia"},
        "resources": {"extra": {"rdma/hca_shared_devices_a": 1}},
        "security": {"capabilities": ["IPC_LOCK"]},
        "pod": {"labels": {"kueue.x-k8s.io/queue-name": "gpu-queue"},
                "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net", "sidecar.istio.io/inject": "false"},
                "serviceAccountName": "llm-runner", "automountServiceAccountToken": True,
                "template": {"metadata": {"labels": {L_ISVC: "hijack"}},
                             "spec": {"hostIPC": True,
                                      "containers": [{"name": "engine", "env": [
                                          {"name": "NCCL_IB_HCA", "value": "mlx5"},
                                          {"name": "HOME", "$patch": "delete"}],
                                          "volumeMounts": [{"mountPath": "/dev/infiniband", "name": "ib"}]},
                                          {"name": "log-shipper", "image": "fluent/fluent-bit:3"}],
                                      "volumes": [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}]}}},
    },
}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_every_rendered_object_is_valid_kubernetes(topology):
    children = render.render(isvc(TOPOLOGIES[topology]), SETTINGS)
    assert children
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_children_are_owned_labelled_and_hashed(topology):
    for obj in render.render(isvc(TOPOLOGIES[topology]), SETTINGS):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llm",
                                            "uid": "0b9a5c1e-uid", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"][L_ISVC] == "llm"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "shoal-operator"
        assert meta["labels"]["app.kubernetes.io/instance"] == "llm"
        assert len(meta["annotations"][render.A_SPEC_HASH]) == 16


def test_rendering_is_deterministic_and_hash_follows_content():
    a = render.render(isvc(TOPOLOGIES["tp4"]), SETTINGS)
    assert a == render.render(isvc(TOPOLOGIES["tp4"]), SETTINGS)
    spec = copy.deepcopy(TOPOLOGIES["tp4"])
    spec["model"]["uri"] = "pvc://models/other"
    b = render.render(isvc(spec), SETTINGS)
    ha = {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][render.A_SPEC_HASH] for o in a}
    hb = {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][render.A_SPEC_HASH] for o in b}
    assert ha[("Deployment", "llm")] != hb[("Deployment", "llm")] and ha[("Service", "llm")] == hb[("Service", "llm")]
    assert ha[("Deployment", "llm-gateway")] == hb[("Deployment", "llm-gateway")]


# What spec.gateway (on by default) adds for an InferenceService named llm.
GATEWAY_KIDS = {("Deployment", "llm-gateway"), ("Service", "llm-engines"), ("ServiceAccount", "llm-gateway"),
                ("Role", "llm-gateway"), ("RoleBinding", "llm-gateway"), ("PodDisruptionBudget", "llm-gateway"),
                ("NetworkPolicy", "llm-gateway")}


def test_cpu_demo_single_pod():
    kids = by_kind(render.render(isvc(TOPOLOGIES["cpu-demo"]), SETTINGS))
    # replicas 1: no PDB for the engines (the gateway has two replicas and its own)
    assert set(kids) == {("Deployment", "llm"), ("Service", "llm"), ("NetworkPolicy", "llm")} | GATEWAY_KIDS
    dep = kids[("Deployment", "llm")]
    c = container(dep)
    assert "command" not in c and c["args"][:2] == ["shoal-engine", "serve"]  # behind the image's init (tini)
    assert "--model" not in c["args"]  # demo:// -> the engine's built-in demo model
    assert flag(c["args"], "--served-model-name") == "llm"
    assert flag(c["args"], "--port") == "8000" and flag(c["args"], "--host") == "0.0.0.0"
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    assert "nvidia.com/gpu" not in str(c["resources"])
    assert c["image"] == "registry.test/shoal-engine:1"
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {L_ISVC: "llm", "app.kubernetes.io/component": "engine"}


@pytest.mark.parametrize("cpu, whole", [("1500m", "2"), (2, "2"), ("500m", "1"), ("3.2", "4"), ("4", "4")])
def test_cpu_engines_get_whole_cpus_as_request_and_limit_and_the_threads_to_match(cpu, whole):
    """A fractional CFS quota stops a step's threads mid-step, and only a Guaranteed pod's whole CPUs get exclusive
    cores from the static CPU manager: CPU-only Shoal engines get whole CPUs (the request rounded up), request ==
    limit, and OMP_NUM_THREADS to match; a user's OMP_NUM_THREADS wins."""
    spec = {**TOPOLOGIES["cpu-demo"], "resources": {"gpusPerPod": 0, "cpu": cpu, "memory": "4Gi"}}
    c = container(by_kind(render.render(isvc(spec), SETTINGS))[("Deployment", "llm")])
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"] == whole
    assert {e["name"]: e.get("value") for e in c["env"]}["OMP_NUM_THREADS"] == whole
    mine = container(by_kind(render.render(isvc({**spec, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}),
                                           SETTINGS))[("Deployment", "llm")])
    assert [e["value"] for e in mine["env"] if e["name"] == "OMP_NUM_THREADS"] == ["1"]
    # GPU engines keep their plain CPU request and get no thread setting
    gpu = container(by_kind(render.render(isvc(TOPOLOGIES["tp4"]), SETTINGS))[("Deployment", "llm")])
    assert "cpu" not in gpu["resources"].get("limits", {}) and "OMP_NUM_THREADS" not in str(gpu["env"])


def test_cpu_pods_see_no_gpu_and_run_on_cpu():
    """On a GPU node whose default runtime is nvidia, the CUDA image's NVIDIA_VISIBLE_DEVICES=all would hand a pod
    without a GPU limit every GPU and `--device auto` would pick CUDA: CPU pods say cpu and hide the GPUs."""
    cpu = {**TOPOLOGIES["cpu-demo"], "model": {"uri": "hf://org/m"}}
    pod = by_kind(render.render(isvc(cpu), SETTINGS))[("Deployment", "llm")]["spec"]["template"]["spec"]
    (c,), (init,) = pod["containers"], pod["initContainers"]
    assert flag(c["args"], "--device") == "cpu"
    for each in (c, init):  # every container of the pod runs on the CUDA image
        env = {e["name"]: e.get("value") for e in each["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == "-1"
        # never an empty value: the API server drops it, and the stored template would never match the render
        assert all(e.get("value") != "" for e in each["env"])
    gpu = container(by_kind(render.render(isvc(TOPOLOGIES["single-gpu"]), SETTINGS))[("Deployment", "llm")])
    assert "--device" not in gpu["args"]  # the device plugin sets GPU visibility
    assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & {e["name"] for e in gpu["env"]}
    with pytest.raises(api.SpecError, match="run on CPU") as e:
        render.render(isvc({**cpu, "engine": {"extraArgs": ["--device=cuda"]}}), SETTINGS)
    assert e.value.field == "spec.engine.extraArgs[0]"


def test_single_gpu_hf_model():
    kids = by_kind(render.render(isvc(TOPOLOGIES["single-gpu"]), SETTINGS))
    c = container(kids[("Deployment", "llm")])
    # the engine loads the model cache's entry the init container verified (a folder, never the hub)
    assert flag(c["args"], "--model") == "/cache/shoal/models/Qwen--Qwen2.5-7B-Instruct@main"
    assert flag(c["args"], "--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HOME"] == "/cache/huggingface" and env["HF_HUB_OFFLINE"] == "1"  # the engine never downloads
    # the engine reads the cache (shared with other pods) and writes only its own subPath of it
    assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in c["volumeMounts"]
    assert {"name": "cache", "mountPath": "/engine-cache", "subPath": "shoal/engine"} in c["volumeMounts"]
    assert [m for m in c["volumeMounts"] if m["name"] == "cache" and not m.get("readOnly")] == [
        {"name": "cache", "mountPath": "/engine-cache", "subPath": "shoal/engine"}]
    # An init container fills the cache the engine reads, with the same HF_HOME and the network allowed.
    pod = kids[("Deployment", "llm")]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    # shoal-podtools, from the operator image: the engine image carries no operator code
    assert init["command"] == ["shoal-podtools"] and init["args"][0] == "download" and init["image"] == SETTINGS.fleet_image
    assert flag(init["args"], "--model") == "Qwen/Qwen2.5-7B-Instruct"
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    assert init_env["HF_HOME"] == "/cache/huggingface" and "HF_HUB_OFFLINE" not in init_env
    assert {"name": "cache", "mountPath": "/cache"} in init["volumeMounts"]
    assert init["securityContext"] == c["securityContext"]


def test_non_hub_models_need_no_download():
    for topology in ("cpu-demo", "tp4"):
        for obj in render.render(isvc(TOPOLOGIES[topology]), SETTINGS):
            if obj["kind"] in ("Deployment", "StatefulSet"):
                assert "initContainers" not in obj["spec"]["template"]["spec"]


def test_tp4_pvc_single_pod_with_four_gpus():
    kids = by_kind(render.render(isvc(TOPOLOGIES["tp4"]), SETTINGS))
    dep = kids[("Deployment", "llm")]
    c = container(dep)
    assert flag(c["args"], "--tensor-parallel-size") == "4" and flag(c["args"], "--pipeline-parallel-size") == "1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert flag(c["args"], "--model") == "/models/llama-70b"
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "--nnodes" not in c["args"]
    pdb = kids[("PodDisruptionBudget", "llm")]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_tp8xpp2_two_pod_groups():
    kids = by_kind(render.render(isvc(TOPOLOGIES["tp8xpp2"]), SETTINGS))
    assert ("Deployment", "llm") not in kids
    for r in (0, 1):
        sts = kids[("StatefulSet", f"llm-g{r}")]
        headless = kids[("Service", f"llm-g{r}")]
        assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == f"llm-g{r}"
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert sts["spec"]["selector"]["matchLabels"][L_GROUP] == str(r)
        assert sts["spec"]["template"]["metadata"]["labels"][L_GROUP] == str(r)
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        c = container(sts)
        args = c["args"]
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--node-rank") == "$(SHOAL_NODE_RANK)"
        assert flag(args, "--master-addr") == f"llm-g{r}-0.llm-g{r}.team-a.svc.cluster.local"
        assert flag(args, "--master-port") == "29500"
        assert c["args"][:2] == ["/bin/sh", "-c"] and "--headless" in c["args"][2] and "command" not in c
        rank = next(e for e in c["env"] if e["name"] == "SHOAL_NODE_RANK")
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{L_POD_INDEX}']"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert c["startupProbe"]["httpGet"]["path"] == "/readyz"  # workers serve /livez and /readyz only
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    engines = kids[("Service", "llm-engines")]
    assert engines["spec"]["selector"][L_POD_INDEX] == "0"  # only rank 0 behind the gateway
    netpol = kids[("NetworkPolicy", "llm")]
    same_isvc = [r for r in netpol["spec"]["ingress"] if "ports" not in r]
    assert same_isvc == [{"from": [{"podSelector": {"matchLabels": {
        L_ISVC: "llm", "app.kubernetes.io/component": "engine"}}}]}]


def test_plan_status_fields():
    p = render.plan(isvc(TOPOLOGIES["tp8xpp2"]), SETTINGS)
    assert p.pods_per_replica == 2 and p.multi_pod and p.gpus_per_pod == 8
    assert p.url == "http://llm.team-a.svc.cluster.local:8000"
    assert p.selector_str == f"app.kubernetes.io/component=engine,{L_POD_INDEX}=0,{L_ISVC}=llm"
    assert render.plan(isvc(), Settings(cluster_domain="k8s.example")).url.endswith(".svc.k8s.example:8000")


@pytest.mark.parametrize("tp,pp,gpus,pods", [
    (4, 3, 4, 3),  # was 2 pods × 8 GPUs with 6 ranks each: 4 GPUs idle, one TP group across two nodes
    (4, 2, 8, 1), (8, 2, 8, 2), (2, 8, 8, 2), (4, 6, 8, 3), (1, 12, 6, 2), (3, 5, 3, 5),
])
def test_default_placement_keeps_tensor_groups_in_one_pod(tp, pp, gpus, pods):
    p = render.plan(isvc({"engine": {"tensorParallelSize": tp, "pipelineParallelSize": pp}}),
                    Settings(max_gpus_per_node=8))
    assert (p.gpus_per_pod, p.pods_per_replica) == (gpus, pods)
    assert gpus % tp == 0 and gpus * pods == tp * pp  # whole TP groups per pod, no idle GPU


def test_cross_node_tensor_parallel_only_when_asked():
    with pytest.raises(api.SpecError) as e:
        render.plan(isvc({"engine": {"tensorParallelSize": 16}}), Settings(max_gpus_per_node=8))
    assert e.value.field == "spec.engine.tensorParallelSize"
    assert "16" in e.value.message and "8 GPUs" in e.value.message and "tensorParallelAcrossPods" in e.value.message
    with pytest.raises(api.SpecError) as e:
        render.plan(isvc({"engine": {"tensorParallelSize": 4}, "resources": {"gpusPerPod": 2}}), SETTINGS)
    assert e.value.field == "spec.resources.gpusPerPod" and "group of 4 across 2 pods" in e.value.message
    p = render.plan(isvc({"engine": {"tensorParallelSize": 16}, "resources": {"tensorParallelAcrossPods": True}}),
                    Settings(max_gpus_per_node=8))
    assert (p.gpus_per_pod, p.pods_per_replica) == (8, 2)


def test_idle_gpus_are_refused_with_the_numbers():
    with pytest.raises(api.SpecError) as e:
        render.plan(isvc({"engine": {"tensorParallelSize": 4, "pipelineParallelSize": 3},
                          "resources": {"gpusPerPod": 8}}), SETTINGS)
    assert e.value.field == "spec.resources.gpusPerPod"
    assert "4 × pipeline 3 = 12 ranks on pods of 8 GPUs would leave 4 requested GPUs idle" in e.value.message


def test_api_key_is_only_a_mounted_secret_of_the_engine_container():
    spec = {**TOPOLOGIES["tp8xpp2"], "security": {"apiKeySecretRef": {"name": "k"}}}
    for obj in render.render(isvc(spec), SETTINGS):
        if obj["kind"] != "StatefulSet":
            continue
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"] + pod["initContainers"]:
            assert not any("SHOAL_API_KEY" in a or a == "--api-key" for a in c.get("command", []) + c["args"])
        # the Secret mounted in the engine container alone, every line a key, re-read on rotation (no restart)
        engine = pod["containers"][0]
        assert not any(e["name"] == "SHOAL_API_KEY" for e in engine["env"])
        assert flag(engine["args"], "--api-key-file") == render.API_KEYS_FILE
        assert {"name": "api-keys", "mountPath": render.API_KEYS_DIR, "readOnly": True} in engine["volumeMounts"]
        assert {"name": "api-keys", "secret": {"secretName": "k", "items": [{"key": "api-key", "path": "keys"}]}} \
            in pod["volumes"]
        assert not any(m["name"] == "api-keys" for c in pod["containers"][1:] + pod["initContainers"]
                       for m in c.get("volumeMounts", []))
        assert not any(e["name"] == "SHOAL_API_KEY" for e in pod["initContainers"][0]["env"])
        assert pod["initContainers"][0]["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}


def test_every_option_reaches_the_pod():
    kids = by_kind(render.render(isvc(TOPOLOGIES["everything"]), SETTINGS))
    dep = kids[("Deployment", "llm")]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    args = c["args"]
    assert args[:4] == ["shoal-engine", "serve", "--model", "/opt/models/m"]
    assert flag(args, "--served-model-name") == "m"
    assert flag(args, "--dtype") == "bfloat16" and flag(args, "--max-model-len") == "8192"
    assert flag(args, "--max-num-seqs") == "64" and flag(args, "--max-num-batched-tokens") == "4096"
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert flag(args, "--attention-backend") == "triton" and "--enforce-eager" in args
    assert flag(args, "--chat-template") == "/etc/shoal/chat-template/template.jinja"
    assert flag(args, "--shutdown-timeout") == "120"
    assert "--api-key" not in args and not any("SHOAL_API_KEY" in a for a in args)  # never in /proc/*/cmdline
    assert args[-2:] == ["--seed", "7"]
    env = {e["name"]: e for e in c["env"]}
    assert "SHOAL_API_KEY" not in env and flag(args, "--api-key-file") == render.API_KEYS_FILE  # the mounted Secret
    assert env["NCCL_DEBUG"]["value"] == "INFO" and env["HF_HUB_OFFLINE"]["value"] == "0"  # user env wins
    assert [e["name"] for e in c["env"]].count("HF_HUB_OFFLINE") == 1
    assert c["image"] == "my.registry/engine:2" and c["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "pull"}]
    assert c["resources"] == {"requests": {"cpu": "16", "memory": "128Gi", "amd.com/gpu": "2",
                                           "ephemeral-storage": "200Gi"},
                              "limits": {"memory": "128Gi", "amd.com/gpu": "2"}}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert vols["cache"]["emptyDir"] == {"sizeLimit": "200Gi"}
    assert vols["chat-template"]["configMap"]["name"] == "llm-chat-template"
    assert kids[("ConfigMap", "llm-chat-template")]["data"] == {"template.jinja": "{{ messages }}"}
    assert pod["nodeSelector"] == {"gpu": "a100"} and pod["priorityClassName"] == "inference"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and "nodeAffinity" in pod["affinity"]
    assert c["startupProbe"]["failureThreshold"] * 4 == 3600  # a held /startupz attempt lasts its 4 s
    # drain: preStop sleep, then --shutdown-timeout, all inside the grace period
    assert pod["terminationGracePeriodSeconds"] > 120 + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    # clients (allowFrom) reach the gateway; the engines only the gateway; metrics from the operator's namespace
    for np_name in ("llm-gateway", "llm"):
        np = kids[("NetworkPolicy", np_name)]
        assert np["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "shoal-system"}
    assert kids[("NetworkPolicy", "llm-gateway")]["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "b"}}}]
    assert kids[("NetworkPolicy", "llm")]["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {L_ISVC: "llm", "app.kubernetes.io/component": "gateway"}}}]


def test_pod_security_and_probes():
    dep = render.render(isvc(), SETTINGS)[0]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/cache", "/tmp"}
    # held up to 4 s and answered the moment the model is loaded, within the probe's 5 s timeout
    assert c["startupProbe"]["httpGet"] == {"path": "/startupz?wait=4", "port": "http"}
    assert c["startupProbe"]["timeoutSeconds"] == 5
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["startupProbe"]["failureThreshold"] == 450  # 1800 s default budget / 4 s per held attempt
    assert c["startupProbe"]["periodSeconds"] == 1
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_scale_down_drains_long_requests_and_a_failing_engine_stops_quickly():
    """A removed replica (scale-down, rollout) finishes its long streams — the default drain is 15 minutes, not
    30 s — while an engine that fails its liveness or startup probe is killed after its own short grace."""
    dep = render.render(isvc(), SETTINGS)[0]
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert flag(c["args"], "--shutdown-timeout") == "900"
    assert pod["terminationGracePeriodSeconds"] == 900 + 5 + 15  # above the drain and the preStop sleep
    assert c["livenessProbe"]["terminationGracePeriodSeconds"] == 30
    assert c["startupProbe"]["terminationGracePeriodSeconds"] == 30
    assert "terminationGracePeriodSeconds" not in c["readinessProbe"]  # the API refuses it there
    gw = by_kind(render.render(isvc(), SETTINGS))[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]
    assert flag(gw["containers"][0]["args"], "--shutdown-timeout") == "900"  # the gateway relays those streams
    custom = render.render(isvc({"engine": {"shutdownTimeoutSeconds": 7200},
                                 "probes": {"failureGracePeriodSeconds": 10}}), SETTINGS)[0]
    assert container(custom)["livenessProbe"]["terminationGracePeriodSeconds"] == 10
    assert custom["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 7200 + 5 + 15


def test_network_policy_disabled_and_zero_replicas():
    kids = by_kind(render.render(isvc(TOPOLOGIES["no-netpol"]), SETTINGS))
    assert set(kids) == {("Deployment", "llm"), ("Service", "llm")} | GATEWAY_KIDS - {("NetworkPolicy", "llm-gateway")}
    assert kids[("Deployment", "llm")]["spec"]["replicas"] == 0


def test_network_policy_admits_metrics_scrapers_on_the_http_port():
    spec = {"security": {"networkPolicy": {"metricsFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]}}}
    settings = Settings(operator_namespace="shoal-system", metrics_namespaces=("monitoring", "shoal-system"))
    np = by_kind(render.render(isvc(spec), settings))[("NetworkPolicy", "llm")]
    (scrape,) = [r for r in np["spec"]["ingress"][1:] if "ports" in r]
    assert scrape["ports"] == [{"port": 8000, "protocol": "TCP"}]
    names = [p.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
             for p in scrape["from"]]
    assert names == ["shoal-system", "monitoring", "observability"]
    assert scrape["from"][2]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    kubernetes_validate.validate(np, K8S_VERSION, strict=True)


def test_platform_knobs_reach_every_pod_template():
    for obj in render.render(isvc(TOPOLOGIES["platform-knobs"]), SETTINGS):
        if obj["kind"] != "StatefulSet":
            continue
        tmpl = obj["spec"]["template"]
        pod, c = tmpl["spec"], tmpl["spec"]["containers"][0]
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
        assert (pod["schedulerName"], pod["runtimeClassName"]) == ("volcano", "nvidia")
        assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("llm-runner", True)
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["initContainers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert tmpl["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        # Kueue reads the queue of the workload it admits (the StatefulSet), not of its pod template
        assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert "k8s.v1.cni.cncf.io/networks" not in obj["metadata"].get("annotations", {})
        assert tmpl["metadata"]["labels"][L_ISVC] == "llm"  # the overlay cannot break the selectors
        assert tmpl["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        # the strategic-merge overlay: merged by name / mountPath, $patch: delete, new sidecar appended
        assert pod["hostIPC"] is True
        env = [e["name"] for e in c["env"]]
        assert "NCCL_IB_HCA" in env and "HOME" not in env and "HF_HOME" in env
        assert [m["mountPath"] for m in c["volumeMounts"]][-1] == "/dev/infiniband"
        assert c["image"] == "registry.test/shoal-engine:1" and c["args"]  # untouched fields stay
        assert [x["name"] for x in pod["containers"]] == ["engine", "log-shipper"]
        assert pod["volumes"][-1] == {"name": "ib", "hostPath": {"path": "/dev/infiniband"}}


@pytest.mark.parametrize("spec,field", [
    ({"pod": {"labels": {"app.kubernetes.io/name": "x"}}}, "spec.pod.labels[app.kubernetes.io/name]"),
    ({"resources": {"extra": {"gpu": 1}}}, "spec.resources.extra[gpu]"),
    ({"pod": {"template": {"spec": {"containers": [{"image": "x"}]}}}}, "spec.pod.template.spec.containers[0]"),
    ({"pod": {"template": {"spec": {"$setElementOrder/containers": []}}}},
     "spec.pod.template.spec.$setElementOrder/containers"),
])
def test_bad_pod_knobs_are_invalid_spec(spec, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc(spec), SETTINGS)
    assert e.value.field == field


def test_model_cache_variants():
    def pod_and_kids(cache, extra=None):
        kids = by_kind(render.render(isvc({"model": {"uri": "hf://org/m", "cache": cache}, **(extra or {})}),
                                     SETTINGS))
        for obj in kids.values():
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        workload = next(o for o in kids.values() if o["kind"] in ("Deployment", "StatefulSet"))
        return workload, kids

    # emptyDir: sized, and the pod requests that much ephemeral storage (no eviction surprise, no overcommit)
    dep, _ = pod_and_kids({"size": "300Gi"})
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "300Gi"}}
    assert container(dep)["resources"]["requests"]["ephemeral-storage"] == "300Gi"
    # an existing claim, shared by every pod
    dep, _ = pod_and_kids({"claimName": "models-rwx"})
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "models-rwx"}
    assert "ephemeral-storage" not in container(dep)["resources"].get("requests", {})
    # the operator's shared ReadWriteMany claim
    dep, kids = pod_and_kids({"persistent": True, "size": "500Gi", "storageClassName": "cephfs"})
    pvc = kids[("PersistentVolumeClaim", "llm-model-cache")]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "500Gi"}},
                           "storageClassName": "cephfs"}
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "llm-model-cache"}
    # one ReadWriteOnce claim per pod of a multi-pod group
    sts, kids = pod_and_kids({"persistent": True, "size": "500Gi", "accessMode": "ReadWriteOnce"},
                             {"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}})
    assert not [k for k in kids if k[0] == "PersistentVolumeClaim"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "cache"
    assert "cache" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in container(sts)["volumeMounts"]
    assert {"name": "cache", "mountPath": "/cache"} in sts["spec"]["template"]["spec"]["initContainers"][0][
        "volumeMounts"]


@pytest.mark.parametrize("cache,field", [
    ({"persistent": True}, "spec.model.cache.size"),
    ({"persistent": True, "size": "1Ti", "claimName": "x"}, "spec.model.cache.claimName"),
    ({"persistent": True, "size": "1Ti", "accessMode": "ReadWriteOnce"}, "spec.model.cache.accessMode"),
])
def test_bad_cache_settings_are_invalid(cache, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"model": {"uri": "hf://org/m", "cache": cache}}), SETTINGS)
    assert e.value.field == field


def test_default_network_policy_allows_same_namespace_only():
    kids = by_kind(render.render(isvc(), Settings()))
    np = kids[("NetworkPolicy", "llm-gateway")]
    assert np["spec"]["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"port": 8000, "protocol": "TCP"}]}]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    # without the gateway, the engines take the clients themselves
    np = by_kind(render.render(isvc({"gateway": {"enabled": False}}), Settings()))[("NetworkPolicy", "llm")]
    assert np["spec"]["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"port": 8000, "protocol": "TCP"}]}]


@pytest.mark.parametrize("spec,field", [
    ({"engine": {"extraArgs": ["--port=9000"]}}, "spec.engine.extraArgs[0]"),
    ({"engine": {"extraArgs": ["--seed", "1", "--tensor-parallel-size", "2"]}}, "spec.engine.extraArgs[2]"),
    ({"resources": {"gpusPerPod": 16}, "engine": {"tensorParallelSize": 16}}, "spec.resources.gpusPerPod"),
    ({"env": [{"value": "x"}]}, "spec.env[0].name"),
    ({"engine": {"tensorParallelSize": 4}, "resources": {"gpusPerPod": 3}}, "spec.resources.gpusPerPod"),
])
def test_semantic_errors_name_the_field(spec, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc(spec), SETTINGS)
    assert e.value.field == field


def test_long_names_are_refused():
    with pytest.raises(api.SpecError) as e:
        render.render(isvc(name="x" * 60), SETTINGS)
    assert e.value.field == "metadata.name"


@pytest.mark.parametrize("spec,limit", [
    ({}, "160Gi"),  # one GPU
    ({"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}}, "2560Gi"),  # 16 GPUs in a group of 2 pods
    ({"resources": {"gpusPerPod": 0, "memory": "6Gi"}}, "24Gi"),  # CPU: 4x the pod's memory
    ({"resources": {"gpusPerPod": 0}}, "100Gi"),
])
def test_a_hub_download_is_bounded_without_a_cache_size(spec, limit):
    """An hf:// cache emptyDir without model.cache.size gets a sizeLimit of what the replica could serve, so a wrong
    model id cannot fill the node's disk; no ephemeral-storage request comes with this default bound."""
    for obj in render.render(isvc({"model": {"uri": "hf://org/m"}, **spec}), SETTINGS):
        if obj["kind"] not in ("Deployment", "StatefulSet") or obj["metadata"]["name"].endswith("-gateway"):
            continue
        vols = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        assert vols["cache"]["emptyDir"] == {"sizeLimit": limit}
        assert "ephemeral-storage" not in container(obj)["resources"].get("requests", {})
    dep = by_kind(render.render(isvc({"model": {"uri": "pvc://claim/m"}}), SETTINGS))[("Deployment", "llm")]
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["emptyDir"] == {}  # nothing downloaded there: only the engine's small caches


def test_inter_rank_traffic_bypasses_a_mesh_sidecar():
    """Multi-pod groups: Istio's sidecar captures only the OpenAI port inbound and lets the rendezvous out, so
    torch.distributed works under STRICT mTLS; single-pod replicas are left alone; the user's annotations win."""
    group = by_kind(render.render(isvc(TOPOLOGIES["tp8xpp2"]), SETTINGS))[("StatefulSet", "llm-g0")]
    annotations = group["spec"]["template"]["metadata"]["annotations"]
    assert annotations["traffic.sidecar.istio.io/includeInboundPorts"] == "8000"
    assert annotations["traffic.sidecar.istio.io/excludeOutboundPorts"] == "29500"
    single = by_kind(render.render(isvc(TOPOLOGIES["single-gpu"]), SETTINGS))[("Deployment", "llm")]
    assert "annotations" not in single["spec"]["template"]["metadata"]
    mine = {"traffic.sidecar.istio.io/includeInboundPorts": "8000,9000"}
    group = by_kind(render.render(isvc({**TOPOLOGIES["tp8xpp2"], "pod": {"annotations": mine}}), SETTINGS))[
        ("StatefulSet", "llm-g0")]
    assert group["spec"]["template"]["metadata"]["annotations"]["traffic.sidecar.istio.io/includeInboundPorts"] \
        == "8000,9000"


def test_kueue_admits_each_multi_pod_group_as_one_gang():
    """With a queue, each group's StatefulSet carries kueue.x-k8s.io/queue-name: Kueue's StatefulSet integration then
    admits it as one pod group (all ranks or none). Its webhook writes the pod-group keys into the template itself
    (the group name derives from the StatefulSet's identity), so the operator renders none of them — and what the
    webhook adds is not drift the reconciler would re-apply forever."""
    from shoal.operator.handlers import _drifted

    spec = {**TOPOLOGIES["tp8xpp2"], "pod": {"labels": {render.KUEUE_QUEUE_LABEL: "gpu"}}}
    for r in (0, 1):
        sts = by_kind(render.render(isvc(spec), SETTINGS))[("StatefulSet", f"llm-g{r}")]
        assert sts["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "gpu"
        tmpl = sts["spec"]["template"]["metadata"]
        assert not [k for k in {**tmpl["labels"], **tmpl.get("annotations", {})}
                    if k.startswith("kueue.x-k8s.io/pod-group")]
        admitted = copy.deepcopy(sts)  # as Kueue's StatefulSet webhook stores it
        admitted["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = f"statefulset-llm-g{r}-x"
        admitted["spec"]["template"]["metadata"]["annotations"].update({
            "kueue.x-k8s.io/pod-group-total-count": "2", "kueue.x-k8s.io/pod-group-serving": "true",
            "kueue.x-k8s.io/pod-group-fast-admission": "true"})
        assert not _drifted(admitted, sts)
