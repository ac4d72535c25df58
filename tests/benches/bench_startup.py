"""Start-up benchmark (not a test): a cold `shoal-engine serve` to ready, phase by phase, with the weights loaded
serially and in parallel; and `shoal-podtools download` from a local hub (a first download, then a start from the
model cache, which verifies every file's sha256).

    cd tests && python -m benches.bench_startup                 # a tiny random model, and, when present,
                                                                # ~/.cache/shoal/smollm2-135m-shape (SmolLM2-135M's
                                                                # shapes, bfloat16 safetensors) and the demo GGUF
    cd tests && python -m benches.bench_startup /path/to/model  # any model folders or .gguf files

(run from tests/, so that the test kits import as under pytest). Each start is a fresh process; the page cache is
warm after the first (the figures are not cold-disk reads). Phases come from the engine's /startupz `startup`
(shoal.engine.startup); `ready` is the wall time from spawning the process to /startupz answering 200.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hubkit import FakeHub
from prockit import free_port, http

from shoal.engine.startup import PHASES

COLUMNS = (*PHASES, "other", "total")


def serve_once(model: str, threads: int) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "SHOAL_LOAD_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model,
                             "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "256", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tempfile.gettempdir())
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"shoal-engine serve {model} exited {proc.returncode}")
            try:
                status, body, _ = http("GET", f"http://127.0.0.1:{port}/startupz", timeout=5)
            except Exception:  # not listening yet
                status = 0
            if status == 200:
                out = json.loads(body)["startup"]
                out["ready"] = time.perf_counter() - t0
                return out
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model}: not ready after 600 s")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def download_once(hub: FakeHub, repo: str, cache: Path) -> float:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "SHOAL_CACHE": str(cache), "HF_HOME": str(cache / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shoal.operator.podtools", "download", "--model", repo,
                    "--termination-log", str(cache / "message")], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def models(argv: list[str], scratch: Path) -> list[str]:
    if argv:
        return argv
    from shoal.engine.tools.tiny_model import make_model

    found = [str(make_model(scratch / "tiny", arch="llama", dtype="bfloat16"))]
    shape = Path.home() / ".cache" / "shoal" / "smollm2-135m-shape"
    if (shape / "config.json").exists():
        found.append(str(shape))
    from shoal.engine.tools.demo_model import find_demo_model

    try:
        gguf = find_demo_model()
        if gguf and Path(gguf).exists():
            found.append(str(gguf))
    except Exception:  # not installed here: no GGUF row
        pass
    return found


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        rows = []
        for model in models(sys.argv[1:], scratch):
            serve_once(model, 1)  # the page cache and the kernel builds warm, so both rows start alike
            for threads in (1, min(8, os.cpu_count() or 1)):
                rows.append((Path(model).name, threads, serve_once(model, threads)))
        print(f"{'model':<20} {'threads':>7} " + " ".join(f"{c[:9]:>9}" for c in (*COLUMNS, "ready")))
        for name, threads, b in rows:
            print(f"{name[:20]:<20} {threads:>7} " + " ".join(
                f"{b[c]:>8.2f}s" if c in b else f"{'-':>9}" for c in (*COLUMNS, "ready")))
        print()
        print(f"{'model':<34} {'first download':>15} {'from the cache':>15} {'MiB':>8}")
        with FakeHub() as hub:
            for model in models(sys.argv[1:], scratch):
                if not Path(model).is_dir():
                    continue
                hub.publish("bench/model", Path(model))
                cache = scratch / f"cache-{Path(model).name}"
                first = download_once(hub, "bench/model", cache)
                cached = download_once(hub, "bench/model", cache)
                size = sum(len(d) for d in hub.repos["bench/model"][1].values()) / 2**20
                print(f"{Path(model).name[:34]:<34} {first:>14.2f}s {cached:>14.2f}s {size:>8.1f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
