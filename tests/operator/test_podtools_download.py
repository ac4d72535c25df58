"""`shoal-podtools download` (the operator's init container for hf:// models) fails clearly without the hub."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer

import pytest
from webkit import QuietHandler


def test_download_without_network_fails_with_the_model_named(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "SHOAL_CACHE": str(tmp_path / "shoal"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "shoal.operator.podtools", "download", "--model", "some-org/some-model"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot fetch 'some-org/some-model'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_download_requires_a_model():
    proc = subprocess.run([sys.executable, "-m", "shoal.operator.podtools", "download"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--model" in proc.stderr


def test_progress_counts_partial_files_against_the_total(tmp_path):
    from shoal.operator.podtools.download import Progress

    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "aaa").write_bytes(b"x" * 2**20)
    progress = Progress(tmp_path / "models--org--m", total=4 * 2**20)
    (blobs / "bbb.incomplete").write_bytes(b"x" * 2**20)  # a resumed partial file counts
    line = progress.line()
    assert line.startswith("downloading: 0.00 GiB of 0.00 GiB (50.0%)") and line.endswith("MiB/s")
    assert "\r" not in line  # plain log lines, no terminal progress bar


class FlakyHub:
    """A stand-in for the hub that answers every request with `status` (and counts them)."""

    def __init__(self, status: int):
        self.requests = 0
        hub = self

        class Handler(QuietHandler):
            def do_GET(self):
                hub.requests += 1
                self.reply(status, b'{"error": "try later"}', "application/json")

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _download(tmp_path, hub: FlakyHub, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp_path), "SHOAL_CACHE": str(tmp_path / "shoal"), "HF_ENDPOINT": hub.url}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "shoal.operator.podtools", "download", "--model", "org/m",
                           "--retry-backoff", "0.05", *extra], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("status", [503, 429])
def test_a_hub_hiccup_is_retried_inside_the_container(tmp_path, status):
    """A transient hub failure is retried with backoff by the download itself: the init container does not exit
    (and restart) for it."""
    hub = FlakyHub(status)
    try:
        proc = _download(tmp_path, hub, "--max-retries", "2")
    finally:
        hub.close()
    assert "retry 1/2" in proc.stdout and "retry 2/2" in proc.stdout and "partial files are kept" in proc.stdout
    assert proc.returncode == 1 and "cannot fetch 'org/m'" in proc.stderr  # given up after the retries
    assert hub.requests >= 3


def test_sigterm_stops_a_download_at_once(tmp_path):
    """The init container runs as PID 1 of the operator image (no init): SIGTERM must end it, not be ignored."""
    hub = FlakyHub(503)
    env = {**os.environ, "HF_HOME": str(tmp_path), "SHOAL_CACHE": str(tmp_path / "shoal"), "HF_ENDPOINT": hub.url}
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.Popen([sys.executable, "-m", "shoal.operator.podtools", "download", "--model", "org/m",
                             "--retry-backoff", "100"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()  # blocks until the first retry is announced (its wait is 100 s)
        assert "retry 1/" in line, f"waited for the first retry line, got {line!r}"
        proc.terminate()
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
        hub.close()
    assert rc == 128 + 15, f"waited for the download to exit on SIGTERM, rc {rc}"


def test_a_missing_model_is_not_retried(tmp_path):
    hub = FlakyHub(404)
    try:
        proc = _download(tmp_path, hub, "--max-retries", "5")
    finally:
        hub.close()
    assert proc.returncode == 1 and "retry" not in proc.stdout


def test_retry_delays_grow(monkeypatch):
    from huggingface_hub import constants

    from shoal.operator.podtools.download import with_retries

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the test session runs offline

    waits: list[float] = []
    calls = []

    class Hiccup(ConnectionError):
        pass

    def fetch():
        calls.append(1)
        if len(calls) < 4:
            raise Hiccup("connection reset by peer")
        return "done"

    assert with_retries(fetch, "org/m", max_retries=5, backoff=1.0, sleep=waits.append) == "done"
    assert len(waits) == 3 and waits[0] < waits[1] < waits[2]  # 1, 2, 4 s (+-20 %)
    with pytest.raises(ValueError):  # a bug is not retried
        with_retries(lambda: (_ for _ in ()).throw(ValueError("bad")), "org/m", 5, 1.0, sleep=waits.append)
    assert len(waits) == 3
