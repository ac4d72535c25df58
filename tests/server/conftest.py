"""Server fixtures: the real `shoal-engine serve` process on a free localhost port, driven over HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from promkit import metric, parse_metrics  # noqa: F401  (re-exported: tests import metric from here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m shoal.engine.cli serve ...` as a child process; logs go to a temporary file."""

    def __init__(self, model_dir, *args: str, env: dict | None = None, served_name: str = "tiny"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = served_name
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shoal-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port), *args]
        e = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        e.pop("SHOAL_API_KEY", None)
        e.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()[-5000:]}")
            status, _ = self.get("/readyz")
            if status == 200:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.logs()[-5000:]}")

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 30.0) -> tuple[int, bytes, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)
        except (urllib.error.URLError, ConnectionError, OSError):
            return 0, b"", {}

    def get(self, path: str, **kw) -> tuple[int, bytes]:
        status, body, _ = self.request("GET", path, **kw)
        return status, body

    def post(self, path: str, body, **kw) -> tuple[int, dict, dict]:
        status, raw, headers = self.request("POST", path, body, **kw)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return status, parsed, headers

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        status, raw = self.get("/metrics", headers=headers)
        assert status == 200, raw
        return parse_metrics(raw.decode())

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return self.proc.returncode


@pytest.fixture(scope="module")
def start_server():
    """start(model_dir, *flags, env=...) -> a ready ServerProcess, stopped at the end of the module."""
    servers: list[ServerProcess] = []

    def start(model_dir, *args, env=None, wait=True, **kw) -> ServerProcess:
        s = ServerProcess(model_dir, *args, env=env, **kw)
        servers.append(s)
        return s.wait_ready() if wait else s

    yield start
    for s in servers:
        s.stop(signal.SIGTERM, timeout=15)
