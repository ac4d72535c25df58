"""The shared gateway end to end on one machine: the emulated API server, the real operator, the local kubelet
(fleetkit) running every engine pod as a real `shoal-engine serve` process, and one real `shoal-gateway --namespace`
process serving every InferenceService of the namespace through one OpenAI endpoint, driven with the openai client.

Three services: `chat` runs (with a LoRA adapter, `sql`), `code` and `idle` scale from zero. Requests go by their
`model` to the service serving it (an adapter to its base model's service); /v1/models lists every model; an unknown
model is a 404 naming no other; a request for `coder` is held, wakes `code` alone (its own wake-up ConfigMap) and
completes once its replica is ready, while `idle` stays at zero.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

import pytest
from fleetkit import Kubelet
from kubekit import isvc_body, wait_for
from prockit import LoggedProcess, free_port, http

from shoal.engine.tools.tiny_lora import make_lora_adapter

openai = importlib.import_module("openai")

ISVC = "inferenceservices"
WAKE = "serving.shoal.dev/wake-requested-at"


def desired(env, ns: str, name: str) -> int | None:
    return ((env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {}).get("desiredReplicas")


def model_ids(gateway: LoggedProcess) -> set[str]:
    status, body, _ = http("GET", gateway.url + "/v1/models", timeout=5)
    return {c["id"] for c in json.loads(body)["data"]} if status == 200 else set()


@pytest.mark.slow
def test_one_endpoint_routes_by_model_and_wakes_only_the_model_asked_for(env, ns, llama_model, tmp_path):
    adapter = make_lora_adapter(tmp_path / "sql", llama_model, rank=4, seed=1)
    engine = {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 10}
    from_zero = {"minReplicas": 0, "maxReplicas": 1, "scaleUpStabilizationSeconds": 0}
    env.client.create(ISVC, ns, isvc_body("chat", {
        "model": {"uri": f"file://{llama_model}", "servedName": "chat"},
        "engine": {**engine, "extraArgs": ["--enable-lora", "--lora-modules", f"sql={adapter}",
                                           "--max-lora-rank", "8"]}}))
    for name, served in (("code", "coder"), ("idle", "idle")):
        env.client.create(ISVC, ns, isvc_body(name, {
            "replicas": 0, "model": {"uri": f"file://{llama_model}", "servedName": served}, "engine": engine,
            "autoscaling": from_zero}))
    wait_for(lambda: env.client.get("deployments", ns, "chat"), 10, "the chat deployment")
    kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=None)
    port = free_port()
    gateway = LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", "--namespace", ns, "--host", "127.0.0.1",
                             "--port", str(port), "--poll-interval", "0.1", "--models-interval", "0.5", "--allow-unauthenticated",
                             "--log-level", "info"], port, log_prefix="shared-gateway-")
    try:
        with kubelet:
            gateway.wait_ready(30)
            wait_for(lambda: {"chat", "sql", "coder", "idle"} <= model_ids(gateway), 240,
                     "chat's replica to be ready and its adapter listed")
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=240)

            def answers(model: str) -> bool:
                try:
                    return bool(client.completions.create(model=model, prompt="warm", max_tokens=1).choices)
                except (openai.APIStatusError, openai.APIConnectionError):
                    return False

            # an engine's first requests may build its CPU kernels, and its readiness flaps meanwhile
            wait_for(lambda: answers("chat") and answers("sql"), 240, "chat and its adapter to answer")
            r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
            assert r.model == "chat" and r.choices[0].message.content is not None
            r = client.completions.create(model="sql", prompt="select", max_tokens=3)  # the adapter, on chat
            assert r.model == "sql"
            models = {m.id: m for m in client.models.list().data}
            assert getattr(models["sql"], "parent", None) == "chat"
            with pytest.raises(openai.NotFoundError) as unknown:
                client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
            assert unknown.value.code == "model_not_found" and "chat" not in str(unknown.value.message)

            # `coder` is at zero: held, its service woken (and no other), answered once its replica is ready
            sent = time.monotonic()
            r = client.completions.create(model="coder", prompt="wake up", max_tokens=3)
            assert r.model == "coder"
            ready = [t for t, pod, what in kubelet.events if what == "ready" and pod.startswith("code-")]
            assert ready and sent < ready[0], kubelet.events
            assert desired(env, ns, "code") == 1
            ups = [e["message"] for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"]
            assert any("0 -> 1 (ScaleFromZero)" in m for m in ups), ups
            assert desired(env, ns, "idle") in (None, 0)
            idle_wake = env.client.get("configmaps", ns, "idle-wake")
            assert WAKE not in (idle_wake["metadata"].get("annotations") or {})
            assert not [p for p in kubelet.pods if p.startswith("idle-")]
            assert kubelet.error is None, kubelet.error
    except BaseException:
        print("kubelet events:", kubelet.events)
        print("gateway log:", gateway.logs()[-6000:])
        for pod in kubelet.pods.values():
            print(f"pod {pod.name} log:", pod.logs()[-3000:])
        raise
    finally:
        gateway.stop(timeout=15)
        for name in ("chat", "code", "idle"):
            env.client.delete(ISVC, ns, name)
