"""`shoal-engine download` (the operator's init container for hf:// models) fails clearly without the hub."""

from __future__ import annotations

import os
import subprocess
import sys


def test_download_without_network_fails_with_the_model_named(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "download", "--model", "some-org/some-model"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot fetch 'some-org/some-model'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_download_requires_a_model():
    proc = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "download"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--model" in proc.stderr


def test_progress_counts_partial_files_against_the_total(tmp_path):
    from shoal.engine.tools.download import Progress

    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "aaa").write_bytes(b"x" * 2**20)
    progress = Progress(tmp_path / "models--org--m", total=4 * 2**20)
    (blobs / "bbb.incomplete").write_bytes(b"x" * 2**20)  # a resumed partial file counts
    line = progress.line()
    assert line.startswith("downloading: 0.00 GiB of 0.00 GiB (50.0%)") and line.endswith("MiB/s")
    assert "\r" not in line  # plain log lines, no terminal progress bar
