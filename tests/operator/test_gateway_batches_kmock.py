"""spec.gateway.batches against the emulated API and the real operator: the claim, its mount and its lifetime; and a
real `shoal-gateway --batch-dir` whose batch, against a service at zero replicas, wakes the autoscaler."""

from __future__ import annotations

import importlib
import io
import json

from fleetkit import GatewayProcess, publish_gateway
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND

from shoal.operator import render
from shoal.operator.contract import A_WAKE
from shoal.operator.gateway.cli import build_parser, config_from_args

openai = importlib.import_module("openai")

ISVC = "inferenceservices"
BATCHES = {"gateway": {"batches": {"enabled": True, "size": "5Gi"}}}


def gateway_pod(env, ns: str, name: str) -> dict:
    return env.client.get("deployments", ns, f"{name}-gateway")["spec"]["template"]["spec"]


def test_the_batch_claim_is_created_mounted_kept_when_turned_off_and_goes_with_the_service(env, ns, tmp_path):
    env.client.create(ISVC, ns, isvc_body("chat", BATCHES))
    claim = wait_for(lambda: env.client.get("persistentvolumeclaims", ns, "chat-gateway-batches"), EVENT_BOUND,
                     "the batch claim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    pod = wait_for(lambda: env.client.get("deployments", ns, "chat-gateway") and gateway_pod(env, ns, "chat"),
                   EVENT_BOUND, "the gateway's Deployment")
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "chat-gateway-batches"}} in pod["volumes"]
    (c,) = pod["containers"]
    # what the operator applied is a command line the gateway takes (its batch dir moved where this test writes)
    args = list(c["args"])
    assert args[args.index("--batch-dir") + 1] == render.GATEWAY_BATCH_DIR
    args[args.index("--batch-dir") + 1] = str(tmp_path)
    assert config_from_args(build_parser().parse_args(args)).batch_dir == str(tmp_path)

    # batches off: the gateway stops mounting the claim, but users' files and results stay
    env.client.patch(ISVC, ns, "chat", {"spec": {"gateway": {"batches": {"enabled": False}}}})
    wait_for(lambda: "volumes" not in gateway_pod(env, ns, "chat"), EVENT_BOUND, "the gateway without the claim")
    wait_for(lambda: not env.operator.memo.reconciler.queue.busy((ns, "chat")), 10, "the reconciler to settle")
    assert env.client.get("persistentvolumeclaims", ns, "chat-gateway-batches") is not None
    # the service deleted: the claim goes with it (ownerReferences)
    env.client.delete(ISVC, ns, "chat")
    wait_for(lambda: env.client.get("persistentvolumeclaims", ns, "chat-gateway-batches") is None, EVENT_BOUND,
             "the claim collected with its service")


def test_a_batch_against_a_service_at_zero_wakes_the_autoscaler(env, ns, tmp_path):
    name = "offline"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 0, "model": {"uri": "hf://org/tiny", "servedName": "tiny"}, **BATCHES,
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 5}}))
    wait_for(lambda: env.client.get("configmaps", ns, f"{name}-wake"), EVENT_BOUND, "the wake-up ConfigMap")
    gateway = GatewayProcess(ns, name, service=f"{name}-engines", extra=("--batch-dir", str(tmp_path)))
    try:
        publish_gateway(env.client, ns, name, gateway.port, gateway.metrics_port)
        c = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=30)
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}
                 for i in range(3)]
        data = "\n".join(json.dumps(line) for line in lines).encode()
        file_id = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
        batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        # no client is held, yet the gateway annotates the wake-up ConfigMap as a held request would ...
        wait_for(lambda: ((env.client.get("configmaps", ns, f"{name}-wake")["metadata"].get("annotations") or {})
                          .get(A_WAKE)), EVENT_BOUND, "the batch's wake-up annotation")
        # ... and the autoscaler scales the service from zero for it
        wait_for(lambda: ((env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {})
                 .get("desiredReplicas") == 1, 30, "the autoscaler to scale from zero for the batch")
        scaled = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"],
                          EVENT_BOUND, "a ScaledUp event")
        assert "0 -> 1 (ScaleFromZero)" in scaled[0]["message"]
        assert c.batches.retrieve(batch.id).status == "in_progress"  # it waits for the engine it woke
    finally:
        gateway.close()
