"""shoal-gateway on the API emulator: discovering engines from a Service's EndpointSlices, and the operator
deploying (and removing) each InferenceService's gateway objects.

The gateway is the real `shoal-gateway --service NAME --namespace NS` process, reading the emulator through the
kubeconfig the `env` fixture writes. The engines behind it are stand-ins serving the engine's HTTP contract as far
as the gateway uses it (/readyz, /metrics, /v1/completions), each recording what reached it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import pytest
from aiohttp import web
from opkit import isvc_body, wait_for
from prockit import LoggedProcess, free_port, http


class StandInEngines:
    """Several engine stand-ins on 127.0.0.1, served by one event loop in a thread."""

    def __init__(self, count: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="stand-in-engines")
        self.thread.start()
        self.ports = [free_port() for _ in range(count)]
        self.seen = {p: 0 for p in self.ports}
        self.runners = [self._run(self._start(p)) for p in self.ports]

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self, port: int) -> web.AppRunner:
        async def readyz(request):
            return web.json_response({"status": "ready"})

        async def metrics(request):
            return web.Response(text='shoal:num_requests_running{model_name="tiny"} 0\n')

        async def complete(request):
            await request.read()
            self.seen[port] += 1
            return web.json_response({"choices": [{"index": 0, "text": str(port)}]})

        app = web.Application()
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    def close(self) -> None:
        for r in self.runners:
            self._run(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def endpoint_slice(name: str, service: str, port: int, ready: bool = True) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready, "serving": True,
                                                                     "terminating": not ready}}],
    }


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    status, raw, headers = http("POST", url, body)
    return status, json.loads(raw or b"{}"), headers


def _gateway_backends(url: str) -> set[str]:
    status, raw, _ = http("GET", url + "/metrics", timeout=5)
    return {line.split('"')[1] for line in raw.decode().splitlines()
            if line.startswith("shoal:gateway_backend_healthy{") and line.endswith(" 1.0")} if status == 200 else set()


@pytest.fixture
def engines():
    e = StandInEngines(3)
    yield e
    e.close()


@pytest.fixture
def gateway(env, ns):
    port = free_port()
    gw = LoggedProcess(
        [sys.executable, "-m", "shoal.engine.gateway", "--service", "llm", "--namespace", ns, "--routing",
         "round-robin", "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.1",
         "--log-level", "warning"], port)
    try:
        gw.wait_ready(30, "/livez")
        yield gw.url
    finally:
        gw.stop(timeout=20)


def test_gateway_follows_ready_endpoints_of_the_service(env, ns, engines, gateway):
    http = env.client.http
    base = f"{env.server.url}/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    a, b, c = engines.ports
    url = {p: f"http://127.0.0.1:{p}" for p in engines.ports}

    # Nothing yet: 503 with Retry-After (never 404).
    status, body, headers = _post(gateway + "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert status == 503 and headers.get("Retry-After") and body["error"]["code"] == "no_backend"

    for name, port in (("llm-a", a), ("llm-b", b)):
        http.post(base, json=endpoint_slice(name, "llm", port)).raise_for_status()
    # A slice of another Service is not ours.
    http.post(base, json=endpoint_slice("other-c", "other", c)).raise_for_status()
    wait_for(lambda: _gateway_backends(gateway) == {url[a], url[b]}, 30, "both engines discovered")
    for i in range(6):
        assert _post(gateway + "/v1/completions", {"model": "tiny", "prompt": f"p{i}"})[0] == 200
    assert engines.seen[a] == 3 and engines.seen[b] == 3 and engines.seen[c] == 0

    # b's pod starts terminating: its endpoint turns not-ready and it gets nothing new.
    r = http.patch(f"{base}/llm-b", data=json.dumps(endpoint_slice("llm-b", "llm", b, ready=False)),
                   headers={"Content-Type": "application/merge-patch+json"})
    r.raise_for_status()
    wait_for(lambda: _gateway_backends(gateway) == {url[a]}, 30, "the draining engine to leave")
    for i in range(4):
        assert _post(gateway + "/v1/completions", {"model": "tiny", "prompt": f"q{i}"})[0] == 200
    assert engines.seen[a] == 7 and engines.seen[b] == 3

    # A new replica appears; a deleted slice takes its engine with it.
    http.post(base, json=endpoint_slice("llm-c", "llm", c)).raise_for_status()
    http.delete(f"{base}/llm-a").raise_for_status()
    wait_for(lambda: _gateway_backends(gateway) == {url[c]}, 30, "the new engine alone")
    assert _post(gateway + "/v1/completions", {"model": "tiny", "prompt": "z"})[0] == 200
    assert engines.seen[c] == 1


# ---- the operator deploys the gateway ------------------------------------------------------------------------
def _get(env, path: str) -> dict | None:
    r = env.client.http.get(env.server.url + path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def test_operator_reconciles_the_gateway(env, ns):
    env.client.create("inferenceservices", ns, isvc_body("llm", {"replicas": 2, "gateway": {"routing": "least-load"}}))
    paths = {
        "Deployment": f"/apis/apps/v1/namespaces/{ns}/deployments/llm-gateway",
        "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts/llm-gateway",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/llm-gateway",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/llm-gateway",
        "engines Service": f"/api/v1/namespaces/{ns}/services/llm-engines",
        "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/llm-gateway",
        "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/llm-gateway",
    }
    for what, path in paths.items():
        wait_for(lambda p=path: _get(env, p), 15, f"the gateway's {what}")
    dep = _get(env, paths["Deployment"])
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routing") + 1] == "least-load" and dep["spec"]["replicas"] == 2
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    service = f"/api/v1/namespaces/{ns}/services/llm"
    wait_for(lambda: _get(env, service)["spec"]["selector"]["app.kubernetes.io/component"] == "gateway", 15,
             "the Service to point at the gateway")

    # Turned off: the gateway's objects go, and the Service points at the engines again.
    env.client.patch("inferenceservices", ns, "llm", {"spec": {"gateway": {"enabled": False}}})
    for what, path in paths.items():
        wait_for(lambda p=path: _get(env, p) is None, 15, f"the gateway's {what} to be deleted")
    wait_for(lambda: _get(env, service)["spec"]["selector"]["app.kubernetes.io/component"] == "engine", 15,
             "the Service to point at the engines")
