"""e2e/gpu (the GPU run of issue 37) on a machine without one: it must refuse at once and clearly, its stages must
enumerate, and a stage's own code must run (here on the CPU), so that a mistake in it shows before a GPU is lent."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "e2e" / "gpu" / "run.sh"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", REPO / "e2e" / "gpu" / "checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def run_script(*args: str, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHON=sys.executable, OUT=str(out)))
    return proc, time.monotonic() - t0


@no_gpu
def test_without_cuda_the_run_fails_fast_and_says_why(tmp_path):
    proc, seconds = run_script(out=tmp_path / "out")
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA device: " in proc.stderr and "sees no GPU" in proc.stderr
    assert seconds < 60, f"the refusal took {seconds:.0f}s"  # importing torch, on a loaded 2-core machine
    assert not (tmp_path / "out").exists()  # nothing installed, nothing run


@no_gpu
def test_checks_refuse_without_cuda_too(checks, tmp_path):
    assert checks.main(["--out", str(tmp_path)]) == 3
    with pytest.raises(checks.NoCuda, match="sees no GPU"):
        checks.cuda_or_die()


def test_stages_enumerate_without_cuda(checks, tmp_path):
    names = [s.name for s in checks.STAGES]
    assert names[:3] == ["environment", "gpu-tests", "gguf-triton-kernels"]
    assert {f"exact-fp32-{f}" for f in ("dense", "sliding-window", "moe", "gguf", "hybrid-gdn", "hybrid-mamba2",
                                        "mla")} <= set(names)
    assert {"half-precision", "cuda-graphs", "sleep-mode", "attention-backends", "openai-serve", "throughput-bench",
            "throughput-8b"} <= set(names)
    assert len(set(names)) == len(names) and all(callable(s.run) and s.budget_s > 0 for s in checks.STAGES)
    proc, _ = run_script("--list", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == names
    proc, _ = run_script("--list", "--only", "no-such-stage", out=tmp_path)
    assert proc.returncode == 2 and "unknown stage 'no-such-stage'" in proc.stderr


def test_gpu_tests_are_found(checks):
    files = checks.gpu_test_files()
    assert "tests/engine/test_graph_capture.py" in files and "tests/engine/test_gpu_script.py" not in files


@pytest.mark.slow
def test_a_family_stage_runs_on_the_cpu(checks, tmp_path, monkeypatch):
    """exact-fp32-dense with the device swapped for the CPU: every mode runs, matches transformers, and reports."""
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    stage = next(s for s in checks.STAGES if s.name == "exact-fp32-dense")
    ctx = checks.Context(tmp_path, tmp_path, time.monotonic() + 600)
    summary = checks.run_stages(ctx, [stage], tmp_path / "gpu-summary.json")
    entry = summary["stages"][0]
    assert entry["status"] == "PASS", entry["error"]
    assert set(entry["figures"]) == set(checks.MODES)
    assert entry["figures"]["prefix-caching"]["prefix_hits"] > 0
    assert entry["figures"]["preemption"]["preemptions"] > 0
    assert (tmp_path / "gpu-summary.json").exists()


def test_the_sleep_stage_runs_on_the_cpu(checks, tmp_path, monkeypatch):
    """sleep-mode on the CPU: both levels free what they say and wake to the same tokens (the CUDA memory figures
    are the GPU's alone)."""
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    stage = next(s for s in checks.STAGES if s.name == "sleep-mode")
    ctx = checks.Context(tmp_path, tmp_path, time.monotonic() + 600)
    entry = checks.run_stages(ctx, [stage], tmp_path / "gpu-summary.json")["stages"][0]
    assert entry["status"] == "PASS", entry["error"]
    assert entry["figures"]["level2"]["reported_asleep"] == {"kv_cache_bytes": 0, "weight_bytes": 0}


def test_a_recurrent_family_stage_runs_on_the_cpu(checks, tmp_path, monkeypatch):
    """exact-fp32-hybrid-mamba2 on the CPU: a model with recurrent state decodes eagerly by design, so the stage
    passes without a captured graph, while prefix caching and preemption still have to happen."""
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    stage = next(s for s in checks.STAGES if s.name == "exact-fp32-hybrid-mamba2")
    ctx = checks.Context(tmp_path, tmp_path, time.monotonic() + 600)
    entry = checks.run_stages(ctx, [stage], tmp_path / "gpu-summary.json")["stages"][0]
    assert entry["status"] == "PASS", entry["error"]
    assert all(entry["figures"][mode]["graphs"] == 0 for mode in checks.MODES)
    assert entry["figures"]["prefix-caching"]["prefix_hits"] > 0
    assert entry["figures"]["preemption"]["preemptions"] > 0
