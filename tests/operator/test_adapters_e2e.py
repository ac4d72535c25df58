"""spec.adapters end to end on one machine: the emulated API, the real operator, and the local kubelet (fleetkit)
running the engine pod as a real `shoal-engine serve` process next to its real adapter-sync sidecar.

The pod turns Ready with its adapters loaded; editing spec.adapters loads and unloads adapters in the running
engine (same process, no new pod); an adapter the engine refuses shows on the status with an Event while the engine
keeps serving; everything goes through the engine's API key.
"""

from __future__ import annotations

import base64
import json

from fleetkit import Kubelet
from kubekit import condition, isvc_body, wait_for
from prockit import EVENT_BOUND, http

from shoal.engine.tools.tiny_lora import make_lora_adapter

ISVC = "inferenceservices"
KEY = "s3cret"


def served_adapters(port: int) -> set[str]:
    status, body, _ = http("GET", f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=10)
    assert status == 200, body
    return {m["id"] for m in json.loads(body)["data"] if m.get("parent")}


def adapter_states(env, ns: str, name: str) -> dict[str, str]:
    found = (env.client.get(ISVC, ns, name).get("status") or {}).get("adapters") or []
    return {a["name"]: "Loaded" if a["readyReplicas"] else "Failed" if a["failedReplicas"] else "Pending"
            for a in found if a["readyReplicas"] + a["failedReplicas"] + a["pendingReplicas"]}


def test_adapters_follow_the_spec_in_the_running_engine(env, ns, llama_model, tmp_path):
    good = make_lora_adapter(tmp_path / "good", llama_model, rank=4, seed=1)
    other = make_lora_adapter(tmp_path / "other", llama_model, rank=8, seed=2)
    big = make_lora_adapter(tmp_path / "big", llama_model, rank=32, seed=3)
    name = "lora"
    # the engine and its sidecar read the key from the mounted Secret (the local kubelet mounts it)
    env.client.create("secrets", ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "key"},
                                      "data": {"api-key": base64.b64encode(KEY.encode()).decode()}})
    env.client.create(ISVC, ns, isvc_body(name, {
        "model": {"uri": f"file://{llama_model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "enableLora": True, "maxLoras": 2, "maxLoraRank": 16},
        "gateway": {"enabled": False}, "security": {"apiKeySecretRef": {"name": "key"}},
        "adapters": [{"name": "good", "uri": f"file://{good}"}, {"name": "big", "uri": f"file://{big}"}]}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=name,
                      env={"SHOAL_API_KEY": KEY})  # the Secret's value, which the pod's env would carry
    try:
        with kubelet:
            (pod_name,) = wait_for(kubelet.ready_pods, 180, "the engine pod to be Ready")
            pod = kubelet.pods[pod_name]
            pid = pod.proc.pid
            # Ready means ready with its adapters: the sidecar's readiness waited for the first list
            assert served_adapters(pod.port) == {"good"}  # (tests/engine/test_lora.py: what serving one computes)

            wait_for(lambda: adapter_states(env, ns, name) == {"good": "Loaded", "big": "Failed"}, 30,
                     "status.adapters: good loaded, big failed")
            cond = condition(env.client.get(ISVC, ns, name), "AdaptersReady")
            assert cond["reason"] == "AdapterLoadFailed" and "above --max-lora-rank 16" in cond["message"], cond
            events = wait_for(lambda: [e for e in env.cluster.find("events", ns)
                                       if e["reason"] == "AdapterLoadFailed"], 10, "an AdapterLoadFailed Event")
            assert f"adapter big on pod {pod_name}" in events[0]["message"]

            # Swap the adapters: the running engine unloads one and loads the other
            env.client.patch(ISVC, ns, name, {"spec": {"adapters": [{"name": "other", "uri": f"file://{other}"}]}})
            wait_for(lambda: served_adapters(pod.port) == {"other"}, 60, "the engine to serve the new list")
            wait_for(lambda: adapter_states(env, ns, name) == {"other": "Loaded"}, 30, "status.adapters updated")
            assert condition(env.client.get(ISVC, ns, name), "AdaptersReady")["status"] == "True"
            assert pod.proc.pid == pid and pod.proc.poll() is None and list(kubelet.pods) == [pod_name]
            assert [what for _t, _p, what in kubelet.events].count("started") == 1  # no restart, no new pod
            assert kubelet.error is None, kubelet.error
    except BaseException:
        for e in env.cluster.find("events", ns):
            print("event:", e.get("reason"), e.get("message"))
        for p in kubelet.pods.values():
            print(f"pod {p.name} log:", p.logs()[-3000:])
            for s in p.sidecars:
                print("sidecar log:", open(s.log_path, encoding="utf-8", errors="replace").read()[-3000:])
        raise
    finally:
        env.client.delete(ISVC, ns, name)
