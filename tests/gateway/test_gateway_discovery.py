"""shoal-gateway on the API emulator (tests/kubekit.py): discovering engines from a Service's EndpointSlices.

The gateway is the real `shoal-gateway --service NAME --namespace NS` process, reading the emulator through the
kubeconfig the `api` fixture writes; the test plays the EndpointSlice controller (no operator runs). The engines
behind it are stand-ins serving the engine's HTTP contract as far as the gateway uses it (/readyz, /metrics,
/v1/completions), each recording what reached it.
"""

from __future__ import annotations

import json
import sys
import uuid

import pytest
from aiohttp import web
from prockit import LoggedProcess, free_port, http, wait_for
from webkit import LoopThread, idle_engine


class StandInEngines(LoopThread):
    """Several engine stand-ins on 127.0.0.1, served by one event loop in a thread."""

    def __init__(self, count: int):
        super().__init__()
        self.ports = [free_port() for _ in range(count)]
        self.seen = {p: 0 for p in self.ports}
        for p in self.ports:
            self.serve(self._app(p), p)

    def _app(self, port: int) -> web.Application:
        async def complete(request):
            await request.read()
            self.seen[port] += 1
            return web.json_response({"choices": [{"index": 0, "text": str(port)}]})

        app = idle_engine("tiny")
        app.router.add_post("/v1/completions", complete)
        return app


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
def ns() -> str:
    return "gw-" + uuid.uuid4().hex[:8]


@pytest.fixture
def engines():
    e = StandInEngines(3)
    yield e
    e.close()


@pytest.fixture
def gateway(api, ns):
    port = free_port()
    gw = LoggedProcess(
        [sys.executable, "-m", "shoal.operator.gateway", "--service", "llm", "--namespace", ns, "--routing",
         "round-robin", "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.1",
         "--log-level", "warning"], port)
    try:
        gw.wait_ready(30, "/livez")
        yield gw.url
    finally:
        gw.stop(timeout=20)


def test_gateway_follows_ready_endpoints_of_the_service(api, ns, engines, gateway):
    http = api.http
    base = f"{api.url}/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
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


@pytest.mark.parametrize("user", [{"token": "sk-123"}, {}])
def test_the_gateway_and_the_operator_read_a_kubeconfig_alike(tmp_path, monkeypatch, user):
    import yaml

    from shoal.operator.k8s.client import KubeAPI

    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443/", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(path))
    api = KubeAPI.from_environment()
    assert (api.server, api.token, api.ssl_context) == ("https://10.0.0.1:6443", user.get("token"), False)
    assert api.headers() == ({"Authorization": "Bearer sk-123"} if user else {})
    from kubernetes import client, config

    c = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=c)
    assert KubeAPI.from_configuration(c) == api
