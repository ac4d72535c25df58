"""Helpers for the gateway tests: real `shoal-engine serve` and `shoal-gateway` processes on 127.0.0.1."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from promkit import metric  # noqa: F401  (re-exported for the fleet tests)
from prockit import LoggedProcess, free_port, http, wait_for  # noqa: F401  (re-exported for the fleet tests)


class Proc(LoggedProcess):
    """`cmd` with --host/--port appended: a gateway or engine on a free port."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        port = free_port()
        super().__init__([*cmd, "--host", "127.0.0.1", "--port", str(port)], port, env, log_prefix="shoal-gw-test-")

    def wait_ready(self, timeout: float = 240.0, path: str = "/readyz") -> "Proc":
        return super().wait_ready(timeout, path)


@contextmanager
def running(procs: list[Proc]):
    """Engines (or gateways) ready for the block, stopped after it (a module fixture's `with running(...) as p:
    yield p`)."""
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def engine_cmd(model_dir) -> list[str]:
    return [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir), "--served-model-name",
            "tiny", "--kv-cache-memory", "32MiB", "--shutdown-timeout", "60"]


def gateway_cmd(*endpoints: str, routing: str = "prefix-load", extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.operator.gateway", "--routing", routing, "--poll-interval", "0.1",
           "--log-level", "warning", *extra]
    for url in endpoints:
        cmd += ["--endpoint", url]
    return cmd




def publish(api, namespace: str, isvc: str, e: LoggedProcess, slice_name: str = "x1") -> None:
    """The EndpointSlice controller's part: the engine is a Ready endpoint of `<isvc>-engines` (one slice per
    engine: a slice has one port, and every engine on 127.0.0.1 has its own)."""
    api.create("endpointslices", namespace, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{isvc}-engines-{slice_name}", "labels": {
            "kubernetes.io/service-name": f"{isvc}-engines", "app.kubernetes.io/managed-by": "shoal-operator"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": e.port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})
