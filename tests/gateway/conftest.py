"""Gateway fixtures: real `shoal-engine serve` replicas and real `shoal-gateway` processes on 127.0.0.1."""

from __future__ import annotations

import pytest
from kubekit import Client, EmulatorServer, write_kubeconfig

from .gwkit import Proc, gateway_cmd


@pytest.fixture(scope="module")
def fleet_model(model_factory):
    # Long contexts, so a generation can outlast the checks made while it streams.
    return model_factory("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def start_gateway():
    """start(*engine_urls, routing=..., extra=(...), ready=True) -> a running shoal-gateway, stopped at the end."""
    procs: list[Proc] = []

    def start(*endpoints: str, routing: str = "prefix-load", extra: tuple[str, ...] = (), ready: bool = True):
        p = Proc(gateway_cmd(*endpoints, routing=routing, extra=extra))
        procs.append(p)
        return p.wait_ready(60, "/readyz" if ready else "/livez")

    yield start
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The emulated API server and a client for it; KUBECONFIG points the gateways this module starts at it."""
    server = EmulatorServer()
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBECONFIG", write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", server.url))
    client = Client(server.url)
    try:
        yield client
    finally:
        client.http.close()
        server.close()
        mp.undo()
