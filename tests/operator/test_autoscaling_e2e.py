"""Autoscaling end to end on one machine: the emulated API server, the real operator (kopf, in a thread), a real
`shoal-gateway` process discovering engines through EndpointSlices, and the local kubelet (fleetkit) running
every engine pod the operator asks for as a real `shoal-engine serve` process with a tiny random model.

From zero replicas a request is held by the gateway, the gateway wakes the operator, a replica starts and the
request completes; a load ramp scales up; idle scales back down to zero, and no client sees an error.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import threading
import time

import pytest
from fleetkit import GatewayProcess, clients_in_a_loop, local_fleet, publish_gateway
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, http

openai = importlib.import_module("openai")
importlib.import_module("shoal.operator.gateway")

ISVC = "inferenceservices"


def running(env, ns: str, name: str) -> int | None:
    """The autoscaler's replica count (status.autoscaling.desiredReplicas); spec.replicas stays the manifest's."""
    return ((env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {}).get("desiredReplicas")


def stream(client, model: str, max_tokens: int) -> tuple[str, float, float]:
    """One streamed chat completion: (text, time of the first token, time of the end)."""
    text, first = "", None
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], stream=True, max_tokens=max_tokens,
        extra_body={"ignore_eos": True})
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            text += chunk.choices[0].delta.content
    return text, first or time.monotonic(), time.monotonic()


@pytest.mark.slow
def test_scale_from_zero_ramp_up_and_back_to_zero_without_client_errors(env, ns, llama_model):
    name = "chat"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 0, "model": {"uri": f"file://{llama_model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 20},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "targetInFlightPerReplica": 2,
                        "scaleUpStabilizationSeconds": 1, "scaleDownStabilizationSeconds": 3,
                        "scaleToZeroAfterSeconds": 5}}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    with local_fleet(env, ns, name) as (kubelet, gateway):
        publish_gateway(env.client, ns, name, gateway.port)  # the operator scrapes its held requests too
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=120)
        assert running(env, ns, name) in (None, 0)

        # 1. from zero: the request is held, a replica starts, the request completes
        sent = time.monotonic()
        text, first_token, _ = stream(client, "tiny", 8)
        assert text
        ready = [t for t, _pod, what in kubelet.events if what == "ready"]
        assert ready and sent < ready[0] <= first_token, kubelet.events  # held until a replica was ready
        scaled = [e for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"]
        assert scaled and "0 -> 1 (ScaleFromZero)" in scaled[0]["message"]

        # 2. a ramp: 5 clients streaming back to back need ceil(5/2) = 3 replicas, capped at 2
        def one_stream():
            assert stream(client, "tiny", 24)[0]

        # 0.3 s between requests, a user reading the answer: leaves CPU for the replica that is starting
        with clients_in_a_loop(5, one_stream, pause=0.3, join_timeout=60):
            wait_for(lambda: running(env, ns, name) == 2, 60, "scale up to 2")
            # bounds, not expectations: a loaded 2-core machine takes up to a minute or two to start an engine
            wait_for(lambda: len(kubelet.ready_pods()) == 2, 180, "second replica ready")
            time.sleep(1.0)  # both replicas serve the load for a moment
        ups = [e["message"] for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"]
        assert any("1 -> 2 (ScaleUp)" in m for m in ups), ups

        # 3. idle: back to zero, pods drained and gone, and nobody saw an error
        wait_for(lambda: running(env, ns, name) == 0, 60, "scale to zero")
        wait_for(lambda: not kubelet.pods, 60, "engine pods gone")
        assert all(what.startswith("exited 0") for _t, _p, what in kubelet.events if what.startswith("exited"))
        reasons = [e["message"] for e in env.cluster.find("events", ns) if e["reason"] == "ScaledDown"]
        assert any("-> 0 (ScaleToZero)" in m for m in reasons), reasons
        assert kubelet.error is None, kubelet.error


def test_unauthenticated_requests_at_zero_never_scale_the_fleet(env, ns):
    """A gateway holding requests for a fleet at zero checks the engines' key first: a flood without it gets 401 at
    once and wakes nothing, while one request with it does wake the autoscaler."""
    name = "keyed"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 0, "model": {"uri": "demo://"}, "security": {"apiKeySecretRef": {"name": "k", "key": "key"}},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 4, "targetInFlightPerReplica": 1,
                        "scaleUpStabilizationSeconds": 0}}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    gateway = GatewayProcess(ns, name, service=f"{name}-engines", hold_timeout=3, env={"SHOAL_API_KEY": "s3cret"})
    try:
        publish_gateway(env.client, ns, name, gateway.port)  # the operator reads held requests from it

        def anonymous(i: int) -> int:
            headers = {"Authorization": "Bearer guess"} if i % 2 else {}
            return http("POST", gateway.url + "/v1/completions", body={"model": name, "prompt": "hi"},
                        headers=headers, timeout=10)[0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            started = time.monotonic()
            codes = list(pool.map(anonymous, range(64)))
        assert codes == [401] * 64 and time.monotonic() - started < 3  # none was held
        time.sleep(2.5)  # several autoscaler ticks
        isvc = env.client.get(ISVC, ns, name)
        assert running(env, ns, name) in (None, 0)
        wake = env.client.get("configmaps", ns, f"{name}-wake")
        assert "serving.shoal.dev/wake-requested-at" not in (wake["metadata"].get("annotations") or {})
        assert not [e for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"]

        # the same gateway with the key: held (503 after its 3 s hold, no engine runs here) and the fleet wakes
        status = http("POST", gateway.url + "/v1/completions", body={"model": name, "prompt": "hi"},
                      headers={"Authorization": "Bearer s3cret"}, timeout=10)[0]
        assert status == 503
        wait_for(lambda: running(env, ns, name) == 1, EVENT_BOUND, "scale from zero")
    except BaseException:
        print("gateway log:", gateway.logs()[-5000:])
        raise
    finally:
        gateway.close()
        env.client.delete(ISVC, ns, name)


@pytest.mark.slow
def test_streams_on_a_replica_removed_by_a_scale_down_complete(env, ns, model_factory):
    """Two replicas each stream a long generation; the fleet is scaled down to one meanwhile. The removed replica
    turns not-ready, drains (engine.shutdownTimeoutSeconds, 900 s by default — not the 2 s failure grace period
    set here, which a confusion of the two would apply) and exits 0 once its stream is done: both clients get
    finish_reason "length", none "abort". The load is read from the gateway's metrics listener (loadSource
    gateways), end to end."""
    model = model_factory("llama", max_position_embeddings=2048)
    name = "drain"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 2, "model": {"uri": f"file://{model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxModelLen": 2048}, "probes": {"failureGracePeriodSeconds": 2},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 2, "loadSource": "gateways"}}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    results: dict[int, tuple] = {}
    with local_fleet(env, ns, name, extra=("--routing", "least-load")) as (kubelet, gateway):
        # the operator reads the load from the gateway's metrics listener (its port "metrics")
        publish_gateway(env.client, ns, name, gateway.port, metrics_port=gateway.metrics_port)
        assert http("GET", f"http://127.0.0.1:{gateway.metrics_port}/v1/models")[0] == 404  # /metrics only
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=300)
        wait_for(lambda: len(kubelet.ready_pods()) == 2, 180, "two replicas ready")
        for pod in list(kubelet.pods.values()):  # the first forward pass may build kernels: not mid-test
            assert http("POST", f"http://127.0.0.1:{pod.port}/v1/completions", timeout=600,
                        body={"model": "tiny", "prompt": "warm up", "max_tokens": 2})[0] == 200
        wait_for(lambda: len(kubelet.ready_pods()) == 2, 60, "two replicas ready after warming up")
        first_tokens = threading.Semaphore(0)

        def long_stream(i: int) -> None:
            finish, tokens, started = None, 0, None
            try:
                for chunk in client.completions.create(model="tiny", prompt=f"story {i}", max_tokens=2000,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    tokens += 1
                    if tokens == 1:
                        started = time.monotonic()
                        first_tokens.release()
                    finish = chunk.choices[0].finish_reason or finish
                results[i] = (finish, started, time.monotonic())
            except BaseException as e:  # noqa: BLE001 - asserted below
                results[i] = (e, started, time.monotonic())
                first_tokens.release()

        threads = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for _ in threads:  # both streams running, one on each replica (least-load routing)
            assert first_tokens.acquire(timeout=120)
        env.client.patch(ISVC, ns, name, {"spec": {"autoscaling": {"minReplicas": 1, "maxReplicas": 1}}})
        terminating = wait_for(lambda: [(t, p) for t, p, what in kubelet.events if what == "terminating"], 30,
                               "a replica removed")
        for t in threads:
            t.join(240)
        assert [r[0] for r in results.values()] == ["length", "length"], results
        (removed_at, victim), = terminating
        exited = wait_for(lambda: [(t, w) for t, p, w in kubelet.events if p == victim
                                   and w.startswith("exited")], 60, "the removed replica exits")
        assert exited[0][1] == "exited 0"
        # both streams (one on each replica) ran across the removal: the victim's was drained, not cut
        assert all(started < removed_at < end for _f, started, end in results.values()), (removed_at, results)
        assert kubelet.error is None, kubelet.error
        # the decisions were made on the gateway's view of both engines, which it exported
        st = env.client.get(ISVC, ns, name)["status"]["autoscaling"]
        assert st["reason"] != "LoadUnknown" and st["desiredReplicas"] == 1, st
