"""Flood vs cold start at the shared gateway, through real processes (issue 30, "How it must be tested"): the emulated
API server (tests/kubekit.py; the test plays the EndpointSlice controller and the autoscaler, no operator runs), one
real `shoal-engine serve` per model and the real `shoal-gateway --all-namespaces --tenant-keys` process.

Two tenants in two namespaces. team-a floods its model past its share of the gateway's waiting room: one request runs
(engine.maxNumSeqs 1: one slot), half of the waiting room takes the next ones, the rest get 429 tenant_queue_full with
Retry-After at once. team-b's model scales from zero: its first requests (a cold start) arrive during the flood, are
held — never refused — until its engine is published, then answered, while team-a's flood is still waiting. The
in-process version with stand-in engines is tests/gateway/test_tenancy.py."""

from __future__ import annotations

import json
import sys
import threading
import uuid

import pytest
from kubekit import isvc_body
from prockit import LoggedProcess

from .gwkit import Proc, free_port, http, metric, publish, wait_for

pytestmark = pytest.mark.slow

MAX_QUEUED = 8  # the gateway's waiting room: a tenant alone may hold half of it
FLOOD = 10


def engine(model_dir, served: str) -> Proc:
    return Proc([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir), "--served-model-name",
                 served, "--kv-cache-memory", "32MiB", "--shutdown-timeout", "0"])


def complete(url: str, key: str, model: str, max_tokens: int) -> tuple[int, dict, dict]:
    status, body, headers = http("POST", url + "/v1/completions", {
        "model": model, "prompt": "the fish of the shoal", "max_tokens": max_tokens, "ignore_eos": True},
        headers={"Authorization": f"Bearer {key}"}, timeout=300)
    return status, json.loads(body or b"{}"), headers


def test_a_flood_on_one_model_gets_429s_while_another_tenants_cold_start_is_admitted(api, fleet_model, tmp_path):
    ns = "fair-" + uuid.uuid4().hex[:6]
    team_a, team_b = f"{ns}-a", f"{ns}-b"
    keys = tmp_path / "tenant-keys"
    keys.mkdir()
    (keys / team_a).write_text("sk-a\n")
    (keys / team_b).write_text("sk-b\n")
    api.create("inferenceservices", team_a, isvc_body("chat", {
        "model": {"uri": "file:///models/a", "servedName": "model-a"}, "engine": {"maxNumSeqs": 1}}))
    api.create("inferenceservices", team_b, isvc_body("code", {
        "replicas": 0, "model": {"uri": "file:///models/b", "servedName": "model-b"},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 1}}))
    engines = {"a": engine(fleet_model, "model-a"), "b": engine(fleet_model, "model-b")}
    port = free_port()
    gateway = LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", "--all-namespaces", "--tenant-keys",
                             str(keys), "--max-queued", str(MAX_QUEUED), "--queue-timeout", "300",
                             "--poll-interval", "0.1", "--models-interval", "0.5", "--shutdown-timeout", "0",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"], port,
                            log_prefix="shared-gateway-")
    results: dict[str, list] = {"a": [], "b": []}
    threads: list[threading.Thread] = []

    def send(tenant: str, key: str, model: str, max_tokens: int) -> None:
        t = threading.Thread(target=lambda: results[tenant].append(complete(gateway.url, key, model, max_tokens)))
        t.start()
        threads.append(t)

    def service(namespace: str, name: str, state: str) -> float:
        return metric(gateway.metrics(), "shoal:gateway_service_requests", namespace=namespace,
                      inferenceservice=name, state=state)

    try:
        for e in engines.values():
            e.wait_ready()
        for name, e in engines.items():  # an engine's first request may build its CPU kernels: not under test
            wait_for(lambda: http("POST", e.url + "/v1/completions", {"model": f"model-{name}", "prompt": "warm",
                                                                       "max_tokens": 1}, timeout=600)[0] == 200,
                     600, f"engine {name}'s first answer")
        publish(api, team_a, "chat", engines["a"])
        gateway.wait_ready(30)
        wait_for(lambda: metric(gateway.metrics(), "shoal:gateway_backend_healthy",
                                backend=engines["a"].url) == 1, 30, "the gateway to find team-a's engine")

        # team-a floods: long answers, so the flood outlasts everything below
        for _ in range(FLOOD):
            send("a", "sk-a", "model-a", 2000)
        wait_for(lambda: len(results["a"]) == FLOOD - 1 - MAX_QUEUED // 2, 60,
                 "team-a's requests beyond its share to be refused")
        assert (service(team_a, "chat", "inflight"), service(team_a, "chat", "queued")) == (1, MAX_QUEUED // 2)
        for status, body, headers in results["a"]:
            assert status == 429 and body["error"]["code"] == "tenant_queue_full", body
            assert int(headers["Retry-After"]) >= 1

        # team-b's cold start during the flood: held for its engine (scale from zero), never refused
        for _ in range(2):
            send("b", "sk-b", "model-b", 4)
        wait_for(lambda: service(team_b, "code", "held") == 2 or results["b"], 30,
                 "team-b's requests to be held for its engine")
        assert not results["b"], results["b"]
        publish(api, team_b, "code", engines["b"])  # the autoscaler woke it, its replica is ready
        wait_for(lambda: len(results["b"]) == 2, 120, "team-b's requests to be answered")
        assert [(status, body.get("model")) for status, body, _ in results["b"]] == [(200, "model-b")] * 2, \
            results["b"]
        # ... while team-a's flood still waited for its slot: B was admitted during the flood, not after it
        assert service(team_a, "chat", "queued") == MAX_QUEUED // 2
        assert len(results["a"]) == FLOOD - 1 - MAX_QUEUED // 2
        assert metric(gateway.metrics(), "shoal:gateway_rejected_total", reason="tenant_queue_full") == \
            FLOOD - 1 - MAX_QUEUED // 2  # none of them team-b's
    except BaseException:
        print("gateway log:", gateway.logs()[-4000:])
        raise
    finally:
        gateway.stop(timeout=15)  # the flood's connections close: the engine aborts what runs
        for e in engines.values():
            e.stop()
        for t in threads:
            t.join(30)
