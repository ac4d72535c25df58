"""Launching `shoal-engine serve` processes for the multi-process tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shoal.engine.distributed.comm import free_port  # noqa: F401 - re-exported for the tests


class Served:
    """One `shoal-engine serve` process with its combined output in a log file."""

    def __init__(self, args: list[str], log: Path, port: int, env: dict | None = None):
        self.port, self.log = port, log
        self._f = open(log, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "shoal.engine.cli", "serve", *args, "--port", str(port)],
                                     stdout=self._f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return -1

    def wait_status(self, path: str, status: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get(path) == status:
                return time.monotonic()
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{path} never answered {status} within {timeout}s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        self._f.flush()
        return self.log.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        m = re.search(r"started local workers \[[^\]]*\] \(pids \[([\d, ]+)\]\)", self.text())
        return [int(p) for p in m.group(1).split(",")] if m else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the workers it started go too
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._f.close()


def pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # exited, not yet reaped by its (dead) parent's adopter


def all_gone(pids: list[int], timeout: float = 5.0) -> bool:
    """Whether every process in `pids` is gone within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not all(pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(pid_gone(p) for p in pids)
