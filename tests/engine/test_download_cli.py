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
