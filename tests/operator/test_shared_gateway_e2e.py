"""The shared gateway end to end on one machine: the emulated API server, the real operator, the local kubelet
(fleetkit) running every engine pod as a real `shoal-engine serve` process, and one real `shoal-gateway --namespace`
process serving every InferenceService of the namespace through one OpenAI endpoint, driven with the openai client.

Three services: `chat` runs (with a LoRA adapter, `sql`), `code` and `idle` scale from zero. Requests go by their
`model` to the service serving it (an adapter to its base model's service); /v1/models lists every model; an unknown
model is a 404 naming no other; a request for `coder` is held, wakes `code` alone (its own wake-up ConfigMap) and
completes once its replica is ready, while `idle` stays at zero.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import time

import pytest
from fleetkit import Kubelet, print_fleet_diagnostics
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, LoggedProcess, free_port, http

from shoal.engine.tools.tiny_lora import make_lora_adapter

openai = importlib.import_module("openai")

ISVC = "inferenceservices"
WAKE = "serving.shoal.dev/wake-requested-at"


def desired(env, ns: str, name: str) -> int | None:
    return ((env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {}).get("desiredReplicas")


def model_ids(gateway: LoggedProcess) -> set[str]:
    status, body, _ = http("GET", gateway.url + "/v1/models", timeout=5)
    return {c["id"] for c in json.loads(body)["data"]} if status == 200 else set()


@contextlib.contextmanager
def serving(env, ns: str, kubelet: Kubelet, gateway: LoggedProcess, services: list[tuple[str, str]]):
    """The local kubelet running and the shared gateway ready for the block; on a failure the fleet's diagnostics;
    whatever happens the gateway stops and the InferenceServices (namespace, name) are deleted."""
    try:
        with kubelet:
            gateway.wait_ready(30)
            yield
    except BaseException:
        print_fleet_diagnostics(env, ns, kubelet, gateway)
        raise
    finally:
        gateway.stop(timeout=15)
        for namespace, name in services:
            env.client.delete(ISVC, namespace, name)


def answers(client, model: str) -> bool:
    """Whether `model` answers a one-token completion through the gateway now (an engine's first requests may
    build its CPU kernels, and its readiness flaps meanwhile)."""
    try:
        return bool(client.completions.create(model=model, prompt="warm", max_tokens=1).choices)
    except (openai.APIStatusError, openai.APIConnectionError):
        return False


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
    wait_for(lambda: env.client.get("deployments", ns, "chat"), EVENT_BOUND, "the chat deployment")
    kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=None)
    port = free_port()
    gateway = LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", "--namespace", ns, "--host", "127.0.0.1",
                             "--port", str(port), "--poll-interval", "0.1", "--models-interval", "0.5",
                             "--allow-unauthenticated",
                             "--log-level", "info"], port, log_prefix="shared-gateway-")
    with serving(env, ns, kubelet, gateway, [(ns, name) for name in ("chat", "code", "idle")]):
        wait_for(lambda: {"chat", "sql", "coder", "idle"} <= model_ids(gateway), 240,
                 "chat's replica to be ready and its adapter listed")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=240)

        # an engine's first requests may build its CPU kernels, and its readiness flaps meanwhile
        wait_for(lambda: answers(client, "chat") and answers(client, "sql"), 240, "chat and its adapter to answer")
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


@pytest.mark.slow
def test_tenants_use_their_namespaces_models_and_what_is_granted_a_hostile_namespace_captures_nothing(
        env, ns, llama_model, tmp_path):
    """Two namespaces, two tenants (a key each), team-b hostile: its older services serve team-a's base name and
    adapter name (at zero replicas: a black hole at no cost) and grant them to everyone. team-a's names stay
    team-a's; team-b's key reaches nothing of team-a's, which answers like an unknown model; /v1/models lists only
    what each caller may use."""
    team_a, team_b = f"{ns}-a", f"{ns}-b"
    adapter = make_lora_adapter(tmp_path / "sql", llama_model, rank=4, seed=1)
    keys = tmp_path / "tenant-keys"
    keys.mkdir()
    (keys / team_a).write_text("sk-team-a\n")
    (keys / f"{team_b}.hostile").write_text("sk-team-b\n")
    from shoal.operator.gateway.fleet import GRANT_ANNOTATION

    for name, served in (("evil-chat", "chat"), ("evil-sql", "sql")):  # first: the older services
        body = isvc_body(name, {"replicas": 0, "model": {"uri": f"file://{llama_model}", "servedName": served}})
        body["metadata"]["annotations"] = {GRANT_ANNOTATION: "*"}
        env.client.create(ISVC, team_b, body)
    env.client.create(ISVC, team_a, isvc_body("chat", {
        "model": {"uri": f"file://{llama_model}", "servedName": "chat"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 10,
                   "extraArgs": ["--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8"]}}))
    wait_for(lambda: env.client.get("deployments", team_a, "chat"), 10, "the chat deployment")
    kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, team_a, engine_service=None)
    port = free_port()
    gateway = LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", "--all-namespaces", "--host",
                             "127.0.0.1", "--port", str(port), "--poll-interval", "0.1", "--models-interval", "0.5",
                             "--tenant-keys", str(keys), "--log-level", "info"], port, log_prefix="shared-gateway-")

    def listed(key: str) -> set[str]:
        status, body, _ = http("GET", gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                               timeout=5)
        return {c["id"] for c in json.loads(body)["data"]} if status == 200 else set()

    services = [(team_a, "chat"), *((team_b, name) for name in ("evil-chat", "evil-sql", "quiet"))]
    with serving(env, team_a, kubelet, gateway, services):
        a = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-team-a", max_retries=0, timeout=240)
        b = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-team-b", max_retries=0, timeout=240)

        wait_for(lambda: "sql" in {c["id"] for c in json.loads(http(
            "GET", gateway.url + "/v1/models", headers={"Authorization": "Bearer sk-team-a"}, timeout=5)[1])[
            "data"] if c.get("parent")}, 240, "team-a's adapter listed by its engine")
        wait_for(lambda: answers(a, "chat") and answers(a, "sql"), 240, "team-a's chat and its adapter to answer")
        # the hijack: team-b's older services serving the same names (granted to all) capture nothing
        assert a.completions.create(model="sql", prompt="select", max_tokens=2).model == "sql"
        assert a.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2).model == "chat"
        assert listed("sk-team-a") == {"chat", "sql"}
        # team-b resolves in its own namespace: its black hole, never team-a's engines
        with pytest.raises(openai.APIStatusError) as own:
            b.completions.create(model="chat", prompt="x", max_tokens=1)
        assert own.value.status_code == 503
        assert listed("sk-team-b") == {"chat", "sql"}  # its own two services
        # the cross-namespace key: team-a's names team-b does not serve look unknown to it
        env.client.create(ISVC, team_b, isvc_body("quiet", {
            "replicas": 0, "model": {"uri": f"file://{llama_model}", "servedName": "quiet"}}))
        wait_for(lambda: "quiet" in listed("sk-team-b"), 30, "team-b's new service listed")
        assert "quiet" not in listed("sk-team-a")  # not granted
        with pytest.raises(openai.NotFoundError) as hidden:
            a.completions.create(model="quiet", prompt="x", max_tokens=1)
        with pytest.raises(openai.NotFoundError) as unknown:
            a.completions.create(model="nope", prompt="x", max_tokens=1)
        assert hidden.value.body == {**unknown.value.body, "message": unknown.value.body["message"].replace(
            "nope", "quiet")}
        status, _, _ = http("GET", gateway.url + "/v1/models", timeout=5)
        assert status == 401  # no key, nothing
        assert kubelet.error is None, kubelet.error
