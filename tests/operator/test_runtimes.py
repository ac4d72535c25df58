"""spec.runtime: each runtime's engine container (command, args, env, probes, ports), valid Kubernetes objects,
and an InvalidSpec naming the runtime for what it cannot honour (operator/runtimes.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import get_args

import kubernetes_validate
import pytest
from fleetkit import VLLM_PYTHON

from shoal.operator.gateway import metric_names
from shoal.operator import api, render, runtimes, status
from shoal.operator.render import Settings

K8S_VERSION = kubernetes_validate.latest_version()
SETTINGS = Settings(engine_image="registry.test/shoal-engine:1", fleet_image="registry.test/shoal-operator:1",
                    operator_namespace="shoal-system")



def isvc(spec: dict, name: str = "llm") -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": "team-a", "uid": "u-1", "generation": 1}, "spec": spec}


def engine_of(children: list[dict]) -> dict:
    (workload,) = [c for c in children if c["kind"] in ("Deployment", "StatefulSet")
                   and c["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"][:1]
    return workload


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def gateway_args(children: list[dict]) -> list[str]:
    (gw,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-gateway")]
    return container(gw)["args"]


FULL_ENGINE = {"tensorParallelSize": 2, "dtype": "bfloat16", "maxModelLen": 8192, "maxNumSeqs": 64,
               "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "enablePrefixCaching": False,
               "enforceEager": True, "kvCacheDtype": "fp8", "quantization": "fp8", "shutdownTimeoutSeconds": 90,
               "extraArgs": ["--seed", "7"]}
VLLM = {"runtime": "vllm", "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": "main",
                                     "chatTemplate": "{{ messages }}"},
        "engine": FULL_ENGINE, "security": {"apiKeySecretRef": {"name": "llm-key", "key": "token"}}}


def test_vllm_single_pod_replica():
    children = render.render(isvc(VLLM), SETTINGS)
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    pod = engine_of(children)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "vllm/vllm-openai:v0.32.0" and c["command"] == ["vllm", "serve"]
    assert c["args"] == [
        "--model", "/cache/shoal/models/Qwen--Qwen2.5-7B-Instruct@main", "--served-model-name", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--dtype", "bfloat16", "--max-model-len", "8192", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
        "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching", "--enforce-eager", "--quantization", "fp8",
        "--kv-cache-dtype", "fp8", "--chat-template", "/etc/shoal/chat-template/template.jinja",
        "--shutdown-timeout", "90", "--seed", "7"]
    env = {e["name"]: e for e in c["env"]}
    # vLLM reads its key from VLLM_API_KEY: from the Secret, never in args, never Shoal's variable
    assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-key", "key": "token"}}
    assert "SHOAL_API_KEY" not in env and not any("key" in a.lower() for a in c["args"])
    assert env["VLLM_NO_USAGE_STATS"]["value"] == "1" and env["HF_HUB_OFFLINE"]["value"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # the hf:// download is `shoal-podtools download`, from the operator image (never run inside vLLM's image)
    (init,) = pod["initContainers"]
    assert init["image"] == SETTINGS.fleet_image and init["command"] == ["shoal-podtools"] and init["args"][0] == "download"
    assert pod["terminationGracePeriodSeconds"] > 90
    # the gateway checks the same key whatever the runtime (VLLM_API_KEY means nothing to it): the Secret mounted and
    # named by --api-key-file, every line a key, re-read on rotation
    (gw_deploy,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-gateway")]
    gw = container(gw_deploy)
    assert gw["volumeMounts"] == [render.API_KEYS_MOUNT]
    assert gw["args"][gw["args"].index("--api-key-file") + 1] == render.API_KEYS_FILE
    assert gw_deploy["spec"]["template"]["spec"]["volumes"] == [
        {"name": "api-keys", "secret": {"secretName": "llm-key", "items": [{"key": "token", "path": "keys"}]}}]
    # the gateway polls /health and reads vllm: gauges
    assert gateway_args(children)[-2:] == ["--runtime", "vllm"]


@pytest.mark.parametrize("runtime, startup, readiness", [("shoal", "/startupz", "/readyz"),
                                                         ("vllm", "/health", "/health")])
def test_status_names_the_probe_of_the_runtime(runtime, startup, readiness):
    template = engine_of(render.render(isvc({"runtime": runtime, "model": {"uri": "pvc://m/x"}}), SETTINGS))
    pod = {"metadata": {"name": "llm-x"}, "spec": template["spec"]["template"]["spec"],
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                      "containerStatuses": [{"name": "engine", "ready": False, "started": False,
                                             "state": {"running": {}}}]}}
    assert status.pod_problem(pod) == ("ModelLoading", f"pod llm-x is loading the model (startup probe ({startup}) "
                                                       "not passed yet)")
    pod["status"]["containerStatuses"][0]["started"] = True
    assert status.pod_problem(pod) == ("ProbeFailing", f"pod llm-x is running but fails its readiness probe "
                                                       f"({readiness})")


def test_the_image_defaults_per_runtime_and_spec_image_wins():
    def image(spec):
        return container(engine_of(render.render(isvc(spec), SETTINGS)))["image"]

    model = {"uri": "pvc://models/qwen"}
    assert image({"model": model}) == SETTINGS.engine_image
    assert image({"runtime": "vllm", "model": model}) == runtimes.VLLM.image
    assert image({"runtime": "sglang", "model": model}) == runtimes.SGLANG.image
    assert image({"runtime": "vllm", "model": model, "image": "my.registry/vllm-cpu:0.32"}) == \
        "my.registry/vllm-cpu:0.32"


def test_vllm_multi_pod_group_is_ray_free_with_headless_ranks():
    spec = {"runtime": "vllm", "model": {"uri": "hf://meta-llama/Llama-3.1-405B"}, "replicas": 2,
            "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}}
    children = render.render(isvc(spec), SETTINGS)
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    sts = [c for c in children if c["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sts] == ["llm-g0", "llm-g1"]
    c = container(sts[1])
    assert c["command"][:2] == ["/bin/sh", "-c"] and 'exec vllm serve "$@"' in c["command"][2]
    assert "--headless" in c["command"][2]
    args = c["args"]
    assert args[args.index("--nnodes"):] == [
        "--nnodes", "2", "--node-rank", "$(SHOAL_NODE_RANK)", "--master-addr",
        "llm-g1-0.llm-g1.team-a.svc.cluster.local", "--master-port", "29500",
        "--distributed-executor-backend", "mp"]
    assert {p["name"] for p in c["ports"]} == {"http", "dist"}
    # headless vLLM ranks serve no HTTP: the probes ask rank 0's /health and pass on other ranks
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["python3", "-c"]
    assert "http://127.0.0.1:8000/health" in probe[2] and "SHOAL_NODE_RANK" in probe[2]


def test_the_rank0_exec_probe_passes_on_workers_and_asks_rank0(tmp_path):
    spec = {"runtime": "vllm", "model": {"uri": "pvc://m/x"},
            "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}}
    c = container(engine_of(render.render(isvc(spec), SETTINGS)))
    script = c["livenessProbe"]["exec"]["command"][2].replace("127.0.0.1:8000", "127.0.0.1:9")  # nobody listens
    run = lambda rank: subprocess.run(["python3", "-c", script], env={**os.environ, "SHOAL_NODE_RANK": rank},
                                      capture_output=True, timeout=30, cwd=tmp_path).returncode  # noqa: E731
    assert run("1") == 0 and run("0") != 0


def test_sglang_renders_its_own_flags():
    spec = {"runtime": "sglang", "model": {"uri": "pvc://models/qwen"},
            "engine": {**{k: v for k, v in FULL_ENGINE.items() if k != "kvCacheDtype"}, "attentionBackend": "triton"}}
    children = render.render(isvc(spec), SETTINGS)
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    c = container(engine_of(children))
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    assert c["args"] == [
        "--model-path", "/models/qwen", "--served-model-name", "llm", "--host", "0.0.0.0", "--port", "8000",
        "--tp-size", "2", "--pp-size", "1", "--dtype", "bfloat16", "--context-length", "8192",
        "--max-running-requests", "64", "--max-prefill-tokens", "4096", "--mem-fraction-static", "0.85",
        "--disable-radix-cache", "--attention-backend", "triton", "--disable-cuda-graph", "--quantization", "fp8",
        "--enable-metrics", "--seed", "7"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway_args(children)[-2:] == ["--runtime", "sglang"]


def test_shoal_is_the_default_and_renders_as_before():
    spec = {"model": {"uri": "pvc://models/qwen"}, "engine": {"kvCacheDtype": "fp8", "quantization": "int8"}}
    default = render.render(isvc(spec), SETTINGS)
    assert default == render.render(isvc({**spec, "runtime": "shoal"}), SETTINGS)
    c = container(engine_of(default))
    assert "command" not in c and c["args"][:2] == ["shoal-engine", "serve"]
    assert c["args"][c["args"].index("--quantization"):][:4] == ["--quantization", "int8", "--kv-cache-dtype", "fp8"]
    assert [c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")] == \
        ["/startupz?wait=4", "/readyz", "/livez"]  # the startup probe held (a long poll)
    assert "--runtime" not in gateway_args(default)  # existing fleets' gateways are not rolled


def test_the_runtime_tables_match_the_spec_and_the_gateway():
    assert tuple(runtimes.RUNTIMES) == get_args(api.InferenceServiceSpec.model_fields["runtime"].annotation)
    assert tuple(runtimes.RUNTIMES) == metric_names.RUNTIMES
    for rt in runtimes.RUNTIMES.values():
        assert rt.metrics is metric_names.for_runtime(rt.name)
        assert rt.readiness.path == rt.metrics.ready_path  # the gateway polls what the kubelet probes


def test_every_engine_option_has_a_mapping_in_the_shoal_runtime():
    # a new spec.engine field must say how each runtime takes it; Shoal's engine takes them all, each by its own
    # flag (test_engine_options.py parses what they render back into the same EngineConfig)
    assert set(api.ENGINE_FLAG_FIELDS) <= set(runtimes.SHOAL.options)
    for rt in runtimes.RUNTIMES.values():
        if rt is not runtimes.SHOAL:  # the others map spec fields one by one
            assert set(rt.options) <= set(api.ENGINE_FLAG_FIELDS), rt.name


@pytest.mark.parametrize("spec, field, words", [
    ({"runtime": "vllm", "model": {"uri": "demo://"}}, "spec.model.uri", "runtime vllm has no built-in demo model"),
    ({"runtime": "vllm", "engine": {"attentionBackend": "sdpa"}}, "spec.engine.attentionBackend",
     "runtime vllm: 'sdpa' has no equivalent"),
    ({"runtime": "vllm", "engine": {"enableLora": True, "maxLoraRank": 48}}, "spec.engine.maxLoraRank",
     "runtime vllm: 48 is not accepted: vLLM accepts only the LoRA ranks 1, 8, 16, 32, 64, 128, 256, 320 and 512"),
    ({"runtime": "vllm", "engine": {"quantization": "int4"}}, "spec.engine.quantization",
     "runtime vllm: 'int4' has no equivalent (vLLM reads GPTQ/AWQ"),
    ({"runtime": "vllm", "engine": {"extraArgs": ["--distributed-executor-backend=ray"]}},
     "spec.engine.extraArgs[0]", "--distributed-executor-backend is set by the operator"),
    ({"runtime": "vllm", "engine": {"extraArgs": ["--max-model-len", "9"], "maxModelLen": 8}},
     "spec.engine.extraArgs[0]", "--max-model-len is set by the operator"),
    ({"runtime": "sglang", "security": {"apiKeySecretRef": {"name": "k"}}}, "spec.security.apiKeySecretRef",
     "runtime sglang takes an API key only as a command-line argument"),
    ({"runtime": "sglang", "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}},
     "spec.engine.tensorParallelSize",
     "runtime sglang runs single-pod replicas only here, and this layout needs 2 pods per replica"),
    ({"runtime": "sglang", "engine": {"extraArgs": ["--model-path", "/x"]}}, "spec.engine.extraArgs[0]",
     "--model-path is set by the operator"),
    ({"runtime": "tgi"}, "spec.runtime", "Input should be 'shoal', 'vllm' or 'sglang'"),
    ({"runtime": "vllm", "engine": {"kvOffloadingSize": 4, "kvOffloadingDiskPath": "/tmp/kv",
                                    "kvOffloadingDiskSize": 8}}, "spec.engine.kvOffloadingDiskPath",
     "runtime vllm has no equivalent setting"),
])
def test_what_a_runtime_cannot_honour_is_an_invalid_spec_naming_it(spec, field, words):
    spec = {"model": {"uri": "pvc://models/qwen"}, **spec}
    with pytest.raises(api.SpecError) as ei:
        render.plan(isvc(spec), SETTINGS)
    assert ei.value.field == field and words in ei.value.message, ei.value


def test_vllm_takes_the_lora_ranks_it_accepts():
    for rank in sorted(runtimes.VLLM_LORA_RANKS):
        spec = {"runtime": "vllm", "model": {"uri": "pvc://models/qwen"},
                "engine": {"enableLora": True, "maxLoraRank": rank}}
        args = container(engine_of(render.render(isvc(spec), SETTINGS)))["args"]
        assert args[args.index("--max-lora-rank") + 1] == str(rank)
    shoal = {"model": {"uri": "pvc://models/qwen"}, "engine": {"enableLora": True, "maxLoraRank": 48}}
    render.render(isvc(shoal), SETTINGS)  # Shoal's engine takes any rank


def test_kv_offloading_renders_as_vllms_flags_for_both_runtimes():
    engine = {"kvOffloadingSize": 4, "kvOffloadingBackend": "native"}
    for runtime in ("shoal", "vllm"):
        spec = {"runtime": runtime, "model": {"uri": "pvc://models/qwen"}, "engine": engine}
        args = container(engine_of(render.render(isvc(spec), SETTINGS)))["args"]
        i = args.index("--kv-offloading-size")
        assert args[i:i + 4] == ["--kv-offloading-size", "4.0", "--kv-offloading-backend", "native"], runtime


def test_the_crd_knows_the_runtime_field():
    import yaml

    crd = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath(
        "crds/inferenceservices.serving.shoal.dev.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["runtime"]["enum"] == ["shoal", "vllm", "sglang"] and props["runtime"]["default"] == "shoal"
    assert props["engine"]["properties"]["kvCacheDtype"]["enum"] == ["auto", "fp8"]


@pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                    reason=f"vLLM is not installed: no python at {VLLM_PYTHON} (set SHOAL_VLLM_PYTHON to the "
                           "python of a virtualenv holding vllm-cpu)")
def test_vllms_own_parser_accepts_the_rendered_arguments(tmp_path):
    """The mapping is checked against vLLM's real argument parser, not against our idea of it."""
    spec = {**VLLM, "engine": {**FULL_ENGINE, "attentionBackend": "cpu"}}
    single = container(engine_of(render.render(isvc(spec), SETTINGS)))["args"]
    multi_spec = {"runtime": "vllm", "model": {"uri": "pvc://m/x"},
                  "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}}
    multi = [a.replace("$(SHOAL_NODE_RANK)", "1") for a in
             container(render.render(isvc(multi_spec), SETTINGS)[1])["args"]] + ["--headless"]
    script = (
        "import json, sys\n"
        "try:\n"
        "    from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"  # where 0.32 keeps `vllm serve`'s
        "except ImportError:\n"
        "    from vllm.entrypoints.openai.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    print(json.dumps({k: str(v) for k, v in vars(ns).items()}))\n")
    import json

    out = subprocess.run([VLLM_PYTHON, "-c", script, json.dumps([single, multi])], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first["model"] == "Qwen/Qwen2.5-7B-Instruct" and first["max_model_len"] == "8192"
    assert first["enable_prefix_caching"] == "False" and first["enforce_eager"] == "True"
    assert first["kv_cache_dtype"] == "fp8" and first["quantization"] == "fp8"
    assert first["attention_backend"].endswith("CPU_ATTN") and first["shutdown_timeout"] == "90"
    assert (second["nnodes"], second["node_rank"], second["headless"]) == ("2", "1", "True")
    assert second["distributed_executor_backend"] == "mp" and second["master_port"] == "29500"
