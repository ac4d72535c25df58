"""autoscaling.scaleToZero sleep end to end on one machine: the emulated API server, the real operator, a real
`shoal-gateway` and the local kubelet (fleetkit) running the engine pod as a real `shoal-engine serve` process.

An idle fleet is parked asleep instead of deleted: its pod stays, its engine frees its memory (as /is_sleeping
reports), the status says so; the next client request through the gateway is held, wakes the parked engine (no
pod start, no process restart) and gets the same greedy answer as before the sleep. A sleep policy the engines
cannot honour is refused with a condition naming the field.
"""

from __future__ import annotations

import importlib
import json
import urllib.request

import pytest
from fleetkit import local_fleet, publish_gateway
from kubekit import condition, isvc_body, wait_for
from prockit import EVENT_BOUND

openai = importlib.import_module("openai")

ISVC = "inferenceservices"
A_SLEEPING = "serving.shoal.dev/sleeping"
PROMPT = "Once upon a time there was a little shoal of fish"


def autoscaling(env, ns: str, name: str) -> dict:
    return (env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {}


def is_sleeping(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_sleeping", timeout=10) as r:
        return json.loads(r.read())


def greedy(client) -> str:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


@pytest.mark.slow
def test_idle_fleet_is_parked_asleep_and_a_request_wakes_it_with_the_same_answer(env, ns, llama_model):
    name = "nap"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 1, "model": {"uri": f"file://{llama_model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 20,
                   "enableSleepMode": True},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleUpStabilizationSeconds": 1,
                        "scaleDownStabilizationSeconds": 2, "scaleToZeroAfterSeconds": 3,
                        "scaleToZero": "sleep", "sleepLevel": 2}}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    deployment = env.client.get("deployments", ns, name)
    gateway_dep = wait_for(lambda: env.client.get("deployments", ns, f"{name}-gateway"), EVENT_BOUND, "gateway")
    gateway_args = next(c for c in gateway_dep["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "gateway")["args"]
    assert "--wake-engines" in gateway_args  # the rendered gateway wakes parked engines itself
    assert deployment["spec"]["replicas"] == 1
    with local_fleet(env, ns, name, extra=("--wake-engines",)) as (kubelet, gateway):
        publish_gateway(env.client, ns, name, gateway.port)
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=120)
        # bound, not expectation: a loaded 2-core machine may take a minute or two to start an engine
        wait_for(lambda: kubelet.ready_pods(), 240, "the first replica ready")
        (pod,) = kubelet.pods.values()
        before = greedy(client)
        assert before
        awake = is_sleeping(pod.port)
        assert awake["is_sleeping"] is False and awake["kv_cache_bytes"] > 0 and awake["weight_bytes"] > 0

        # 1. idle: parked asleep, the pod kept, its memory freed, the status says so
        wait_for(lambda: autoscaling(env, ns, name).get("sleepingReplicas") == 1, 60, "the replica parked")
        asleep = is_sleeping(pod.port)
        assert asleep["is_sleeping"] is True and asleep["level"] == 2
        assert asleep["kv_cache_bytes"] == 0 and asleep["weight_bytes"] == 0
        assert list(kubelet.pods) == [pod.name] and pod.proc.poll() is None  # same pod, same process
        assert env.client.get("deployments", ns, name)["spec"]["replicas"] == 1  # scaled to zero, pod kept
        assert env.client.get("pods", ns, pod.name)["metadata"]["annotations"][A_SLEEPING] == "2"
        wait_for(lambda: not kubelet.ready_pods(), 30, "the parked pod not Ready (its /readyz fails)")
        ready = wait_for(lambda: (c := condition(env.client.get(ISVC, ns, name), "Ready"))
                         and c["reason"] == "ScaledToZero" and "asleep" in c["message"] and c, 30,
                         "Ready=True ScaledToZero with the replica asleep")
        assert ready["status"] == "True", ready
        parked = [e["message"] for e in env.cluster.find("events", ns) if e["reason"] == "ParkedAsleep"]
        assert parked and pod.name in parked[0], parked

        # 2. a request: held by the gateway, which wakes the parked engine; the same greedy answer, no error
        assert greedy(client) == before
        assert pod.proc.poll() is None and list(kubelet.pods) == [pod.name]  # woken, never restarted
        assert not [what for _t, _p, what in kubelet.events if what.startswith("exited")], kubelet.events
        assert "woke the engine at" in gateway.logs()
        # the operator reads the wake-up from /is_sleeping: no longer counted asleep
        wait_for(lambda: autoscaling(env, ns, name).get("sleepingReplicas") == 0 or
                 is_sleeping(pod.port)["is_sleeping"], 30, "the wake-up seen by the operator")
        assert kubelet.error is None, kubelet.error


@pytest.mark.parametrize("spec, message", [
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZero": "sleep"}}, "needs engine.enableSleepMode"),
    ({"engine": {"enableSleepMode": True}, "autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                                                           "scaleToZero": "sleep"}}, "set minReplicas: 0"),
    ({"runtime": "vllm", "engine": {"enableSleepMode": True},
      "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZero": "sleep"}}, "runtime vllm has no sleep mode"),
])
def test_a_sleep_policy_the_engines_cannot_honour_is_refused_with_a_clear_condition(env, ns, spec, message):
    env.client.create(ISVC, ns, isvc_body("bad", {"model": {"uri": "hf://org/m"}, **spec}))
    cond = wait_for(lambda: (c := condition(env.client.get(ISVC, ns, "bad"), "Ready")) and c["status"] == "False"
                    and c, EVENT_BOUND, "Ready=False on the invalid spec")
    assert cond["reason"] == "InvalidSpec" and "autoscaling.scaleToZero" in cond["message"], cond
    assert message in cond["message"], cond
    assert env.client.get("deployments", ns, "bad") is None  # nothing half-applied
