"""The per-service gateway knows the adapters its InferenceService declares (issue 30, item 12), through real
processes: the emulated API server (tests/kubekit.py; the test plays the EndpointSlice controller, no operator
runs), one real `shoal-engine serve` with LoRA on and no adapter loaded, and the real `shoal-gateway --service
llm-engines --inference-service llm` the operator renders. A request for an adapter spec.adapters declares that
the engine has not loaded yet is held — not answered 404 by the engine — until the engine loads it, also for an
adapter added to the spec while the gateway runs (no restart); one never loaded gets 503 adapter_not_loaded after
--queue-timeout, exactly as at the shared gateway."""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid

import openai
import pytest
from kubekit import isvc_body
from prockit import LoggedProcess

from shoal.engine.tools.tiny_lora import make_lora_adapter

from .gwkit import Proc, engine_cmd, free_port, http, metric, wait_for

pytestmark = pytest.mark.slow

QUEUE_TIMEOUT = 8  # seconds a request for an adapter no engine lists may wait


def adapters_spec(*names: str) -> list[dict]:
    return [{"name": n, "uri": f"file:///adapters/{n}"} for n in names]


def load(engine, name: str, path) -> None:
    status, body, _ = http("POST", engine.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert status == 200, body


def test_a_declared_adapter_is_held_until_the_engine_loads_it_and_one_never_loaded_gets_503(
        api, fleet_model, tmp_path):
    ns = "gw-" + uuid.uuid4().hex[:8]
    adapter = make_lora_adapter(tmp_path / "ad", fleet_model, rank=4, seed=7)
    engine = Proc([*engine_cmd(fleet_model), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"])
    port = free_port()
    gateway = LoggedProcess(
        [sys.executable, "-m", "shoal.operator.gateway", "--service", "llm-engines", "--namespace", ns,
         "--inference-service", "llm", "--port-name", "http", "--routing", "round-robin",
         "--queue-timeout", str(QUEUE_TIMEOUT), "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.1",
         "--log-level", "info"], port, log_prefix="shoal-gw-test-")
    try:
        api.create("inferenceservices", ns, isvc_body("llm", {
            "model": {"uri": "file:///models/tiny", "servedName": "tiny"}, "engine": {"enableLora": True},
            "adapters": adapters_spec("ad", "ghost")}))
        engine.wait_ready()
        api.create("endpointslices", ns, {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "llm-engines-x1", "labels": {"kubernetes.io/service-name": "llm-engines"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": engine.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})
        gateway.wait_ready(30)

        def seen(name: str) -> float | None:
            return gateway.metrics().get(f"shoal:gateway_{name}")

        wait_for(lambda: seen("declared_adapters") == 2, 30, "the gateway to read spec.adapters")
        wait_for(lambda: seen(f'backend_adapters{{backend="{engine.url}"}}') == 0, 30,
                 "the gateway to read the engine's (empty) adapter list")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        # an engine's first requests may build its CPU kernels: the base model answers first
        wait_for(lambda: http("POST", gateway.url + "/v1/completions", {"model": "tiny", "prompt": "warm",
                                                                        "max_tokens": 1}, timeout=600)[0] == 200,
                 600, "the engine's first answer")

        def held_then_served(model: str) -> None:
            results: list = []
            # the engine's readiness may flap while the machine is loaded (its loop's heartbeat)
            wait_for(lambda: seen(f'backend_healthy{{backend="{engine.url}"}}') == 1, 60, "a ready engine")

            def ask():
                try:
                    results.append(client.completions.create(model=model, prompt="held", max_tokens=2).model)
                except openai.APIError as e:
                    results.append(e)
            t = threading.Thread(target=ask)
            t.start()
            try:
                wait_for(lambda: seen("adapter_wait_requests") == 1 or results, 30,
                         f"the request for {model} to wait for its adapter")
                assert not results, results  # held: not the engine's 404
                load(engine, model, adapter)
            finally:
                t.join(60)
            assert results == [model], results

        held_then_served("ad")
        # an adapter added to the spec while the gateway runs: known from the watch, no restart
        pid = gateway.proc.pid
        api.patch("inferenceservices", ns, "llm", {"spec": {"adapters": adapters_spec("ad", "ghost", "late")}})
        wait_for(lambda: seen("declared_adapters") == 3, 30, "the gateway to see the new adapter in the spec")
        held_then_served("late")
        assert gateway.proc.pid == pid and gateway.proc.poll() is None

        # declared, never loaded: 503 adapter_not_loaded with Retry-After once --queue-timeout has passed
        sent = time.monotonic()
        status, body, headers = http("POST", gateway.url + "/v1/completions",
                                     {"model": "ghost", "prompt": "x", "max_tokens": 1}, timeout=60)
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["code"] == "adapter_not_loaded" and "`ghost`" in error["message"] and error["param"] == "model"
        assert headers.get("Retry-After") and time.monotonic() - sent >= QUEUE_TIMEOUT
        # a name the spec does not declare still goes to the engine, which answers for it
        status, body, _ = http("POST", gateway.url + "/v1/completions",
                               {"model": "nope", "prompt": "x", "max_tokens": 1}, timeout=60)
        assert status == 404, body
        assert metric(gateway.metrics(), "shoal:gateway_retries_total", reason="status_404") == 0
    except BaseException:
        print("gateway log:", gateway.logs()[-4000:])
        print("engine log:", engine.logs()[-4000:])
        raise
    finally:
        gateway.stop(timeout=15)
        engine.stop()
