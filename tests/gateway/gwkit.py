"""Helpers for the gateway tests: real `shoal-engine serve` and `shoal-gateway` processes on 127.0.0.1."""

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

from promkit import metric, parse_metrics  # noqa: F401  (metric re-exported for the fleet tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, bytes, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0, b"", {}


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Proc:
    """A child process with its log in a temporary file."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shoal-gw-test-", suffix=".log", delete=False)
        e = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        e.pop("SHOAL_API_KEY", None)
        e.update(env or {})
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=e)

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, path: str, **kw) -> tuple[int, bytes]:
        status, body, _ = http("GET", self.url + path, **kw)
        return status, body

    def metrics(self) -> dict[str, float]:
        status, raw = self.get("/metrics")
        assert status == 200, raw
        return parse_metrics(raw.decode())

    def wait_ready(self, timeout: float = 240.0, path: str = "/readyz") -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            if self.get(path, timeout=5)[0] == 200:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} not ready after {timeout}s:\n{self.logs()[-4000:]}")

    def signal(self, sig) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
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


def engine_cmd(model_dir) -> list[str]:
    return [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir), "--served-model-name",
            "tiny", "--kv-cache-memory", "32MiB", "--shutdown-timeout", "60"]


def gateway_cmd(*endpoints: str, routing: str = "prefix-load", extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.engine.gateway", "--routing", routing, "--poll-interval", "0.1",
           "--log-level", "warning", *extra]
    for url in endpoints:
        cmd += ["--endpoint", url]
    return cmd


