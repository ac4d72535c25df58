"""Helpers for the gateway tests: real `shoal-engine serve` and `shoal-gateway` processes on 127.0.0.1."""

from __future__ import annotations

import sys

from promkit import metric  # noqa: F401  (re-exported for the fleet tests)
from prockit import LoggedProcess, free_port, http, wait_for  # noqa: F401  (re-exported for the fleet tests)


class Proc(LoggedProcess):
    """`cmd` with --host/--port appended: a gateway or engine on a free port."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        port = free_port()
        super().__init__([*cmd, "--host", "127.0.0.1", "--port", str(port)], port, env, log_prefix="shoal-gw-test-")

    def wait_ready(self, timeout: float = 240.0, path: str = "/readyz") -> "Proc":
        return super().wait_ready(timeout, path)


def engine_cmd(model_dir) -> list[str]:
    return [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir), "--served-model-name",
            "tiny", "--kv-cache-memory", "32MiB", "--shutdown-timeout", "60"]


def gateway_cmd(*endpoints: str, routing: str = "prefix-load", extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.operator.gateway", "--routing", routing, "--poll-interval", "0.1",
           "--log-level", "warning", *extra]
    for url in endpoints:
        cmd += ["--endpoint", url]
    return cmd


