"""Real server processes for the tests that drive them over HTTP: a free localhost port, a urllib call that
answers (status, body, headers) instead of raising, and a child process whose output goes to a temporary log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from signal import SIGCONT, SIGTERM  # by name: the class below has a method called signal

from typing import Any

from promkit import parse_metrics


# How long a test waits for an event of the system under test (a reconcile, an Event, a scale, a status): far above
# any realistic delay on a loaded machine, so that only a missing event fails a test, never a slow one.
EVENT_BOUND = 120.0


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """The first truthy value of `predicate()`, polled every 20 ms; an AssertionError naming `what` (and the last
    value) after `timeout` seconds. A predicate that raises KeyError, TypeError, IndexError or AttributeError (an
    object or field not there yet) counts as not yet. The one wait helper of the tests."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError, AttributeError):
            last = None
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, bytes, dict]:
    """(status, body, headers); status 0 when nothing answered."""
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


class LoggedProcess:
    """`cmd` (which listens on `port` of 127.0.0.1) as a child process, its output in a temporary log file. The
    environment keeps tokenizers and OpenMP to one thread each and drops any SHOAL_API_KEY of the caller's."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None, log_prefix: str = "shoal-test-",
                 cwd: str | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
        e = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        e.pop("SHOAL_API_KEY", None)
        e.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e, cwd=cwd)

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, path: str, **kw) -> tuple[int, bytes]:
        status, body, _ = http("GET", self.url + path, **kw)
        return status, body

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        status, raw = self.get("/metrics", headers=headers)
        assert status == 200, raw
        return parse_metrics(raw.decode())

    def wait_ready(self, timeout: float = 90.0, path: str = "/readyz"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}:\n{self.logs()[-5000:]}")
            if self.get(path, timeout=5)[0] == 200:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} not ready after {timeout}s:\n{self.logs()[-5000:]}")

    def signal(self, sig) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig=SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` (after SIGCONT: a SIGSTOPped process handles nothing), wait, kill if it hangs; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(SIGCONT)
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
