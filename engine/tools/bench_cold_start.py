"""Scale from zero to the first token, four ways (a benchmark that prints numbers; not a test):

    python -m shoal.engine.tools.bench_cold_start                      # the demo SmolLM2 GGUF if it is cached
    python -m shoal.engine.tools.bench_cold_start --model DIR_OR_GGUF  # any model

  fetch   a fresh pod whose model is not cached: the model files are copied into an empty cache folder (a local
          copy stands in for the download: this machine is offline; the size is printed with what the download
          would add at 1 Gbit/s), then the engine starts from there;
  cache   a fresh pod with the model already on local disk (and what a first start derived from it, a GGUF's
          converted tokenizer, in $SHOAL_CACHE): process start, imports, weights, warm-up;
  sleep1  an engine parked with POST /sleep?level=1 (KV cache freed, weights kept): POST /wake_up, first token;
  sleep2  the same at level 2 (weights freed too, read again from the model files on wake-up);
  awake   the baseline: the same request on an awake, warm engine (what no start at all costs).

Each line carries its breakdown, measured from outside the engine process as a pod start would be:
  process  a bare `python -c pass` (interpreter start),
  imports  `import shoal.engine.server.run` minus that (the server's modules, torch among them),
  weights  from the server's "listening" log line (it listens before loading) to its "KV cache" line (the model
           built and its weights loaded, the KV cache sized),
  warm-up  from there to /readyz answering 200 (the KV cache allocated, warm-up and capture),
  wake     POST /wake_up's round trip (sleep cases),
  first    a streamed chat completion's first token, sent the moment the engine is ready.
The JIT-built CPU kernels are built once before the figures (an unmeasured start), as a pod whose kernel cache
is on its cache volume finds them; the first line printed says how long that build took.
The "listening" mark includes the process and imports of the real start (they are not subtracted there), so
process + imports is the separate measurement and `total` is the real wall time from spawn to the first token.
Other engineers' jobs share this machine: run it when it is quiet, and read the load printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from shoal.engine.tools.demo import free_port

PROMPT = [{"role": "user", "content": "Say hello in five words."}]
# The baseline's prompt: as long, but not in the prefix cache (every start and wake-up begins with an empty one)
OTHER_PROMPT = [{"role": "user", "content": "Name five kinds of fish."}]


def _timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def process_and_imports() -> tuple[float, float]:
    """(interpreter start, the server's imports), each the best of three runs (the page cache warm)."""
    bare = min(_timed([sys.executable, "-c", "pass"]) for _ in range(3))
    full = min(_timed([sys.executable, "-c", "import shoal.engine.server.run"]) for _ in range(3))
    return bare, max(full - bare, 0.0)


class Engine:
    """A `shoal-engine serve` process whose log lines are stamped as they arrive."""

    def __init__(self, model: str, extra: list[str], env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.marks: dict[str, float] = {}
        self.lines: list[str] = []
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--enable-sleep-mode", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env={**os.environ, **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.perf_counter()
            self.lines.append(line)
            for mark, text in (("listening", "listening on"), ("kv", "KV cache:"), ("ready", "ready: serving")):
                if text in line and mark not in self.marks:
                    self.marks[mark] = now

    def wait_ready(self, timeout: float = 900) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the engine exited:\n" + "".join(self.lines[-30:]))
            try:
                with urllib.request.urlopen(self.base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter()
            except OSError:
                pass
            time.sleep(0.01)
        raise TimeoutError("the engine did not become ready:\n" + "".join(self.lines[-30:]))

    def post(self, path: str, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.base + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def first_token(self, prompt: list[dict] = PROMPT) -> tuple[float, str]:
        """Seconds to the first streamed token of a chat completion, and the whole (greedy) answer."""
        body = json.dumps({"model": self.model_name(), "messages": prompt, "max_tokens": 16, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(self.base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t, first, text = time.perf_counter(), None, ""
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter() - t
                    text += delta
        return first if first is not None else time.perf_counter() - t, text

    def model_name(self) -> str:
        with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cold(model: str, extra: list[str], base: tuple[float, float], fetch: float | None = None,
         env: dict | None = None) -> dict:
    """A fresh engine process to the first token."""
    engine = Engine(model, extra, env)
    try:
        ready = engine.wait_ready()
        first, text = engine.first_token()
        m = engine.marks
        kv = m.get("kv", m.get("listening", engine.spawned))
        out = {"process": base[0], "imports": base[1], "weights": kv - m.get("listening", engine.spawned),
               "warm-up": ready - kv, "first": first,
               "start→listening": m.get("listening", ready) - engine.spawned,
               "total": ready - engine.spawned + first, "answer": text}
        if fetch is not None:
            out = {"fetch": fetch, **out, "total": out["total"] + fetch}
        return out
    finally:
        engine.stop()


def from_sleep(engine: Engine, level: int) -> dict:
    engine.post(f"/sleep?level={level}")
    with urllib.request.urlopen(engine.base + "/is_sleeping", timeout=10) as r:
        asleep = json.loads(r.read())
    t = time.perf_counter()
    engine.post("/wake_up")
    wake = time.perf_counter() - t
    first, text = engine.first_token()
    return {"wake": wake, "first": first, "total": wake + first, "answer": text,
            "freed": f"kv {asleep['kv_cache_bytes'] / 2**20:.0f} MiB, weights "
                     f"{asleep['weight_bytes'] / 2**20:.0f} MiB resident asleep"}


def files_of(model: Path) -> list[Path]:
    return [model] if model.is_file() else [p for p in model.iterdir() if p.is_file()]


def default_model() -> tuple[str, str]:
    from shoal.engine.tools import demo_model

    found = demo_model.find_demo_model()
    if found is not None:
        return str(found), demo_model.MODEL_LABEL
    from shoal.engine.tools.bench_throughput import bench_model_dir

    path = bench_model_dir("smollm2-135m")
    return str(path), (f"{demo_model.MODEL_LABEL} is not cached on this machine (offline): SmolLM2-135M's shape "
                       "with random bf16 weights instead (same layers, widths and vocabulary)")


def line(name: str, r: dict) -> str:
    parts = [f"{k} {v:.2f}s" for k, v in r.items() if isinstance(v, float) and k != "total"]
    extra = f"  [{r['freed']}]" if "freed" in r else ""
    return f"{name:<7} total {r['total']:6.2f}s to the first token = " + ", ".join(parts) + extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory or GGUF file (default: the demo SmolLM2 GGUF if cached)")
    p.add_argument("--engine-arg", action="append", default=[], help="more shoal-engine serve flags")
    args = p.parse_args(argv)
    model, label = (args.model, args.model) if args.model else default_model()
    print(f"model: {label}\n  {model}", flush=True)
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs", flush=True)
    t = time.perf_counter()
    prime = Engine(model, args.engine_arg)  # builds (or finds) the CPU kernels; not part of any figure
    try:
        prime.wait_ready()
    finally:
        prime.stop()
    print(f"kernel build (or cache check) and a first start, unmeasured: {time.perf_counter() - t:.1f}s",
          flush=True)
    base = process_and_imports()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cold-start-") as cache:
        src = Path(model)
        t = time.perf_counter()
        for f in files_of(src):
            shutil.copyfile(f, Path(cache) / f.name)
        fetch = time.perf_counter() - t
        size = sum(f.stat().st_size for f in files_of(src))
        fetched = str(Path(cache) / src.name) if src.is_file() else cache
        # an empty $SHOAL_CACHE too: what the engine derives from the model (a GGUF's converted tokenizer) is
        # not there yet for a first pod; the CPU kernels are (built above, as a node's kernel cache holds them)
        results["fetch"] = cold(fetched, args.engine_arg, base, fetch, env={"SHOAL_CACHE": f"{cache}/shoal"})
    results["cache"] = cold(model, args.engine_arg, base)
    engine = Engine(model, args.engine_arg)
    try:
        engine.wait_ready()
        before = engine.first_token()[1]
        warm, _ = engine.first_token(OTHER_PROMPT)  # the baseline: an awake, warm engine, no prefix-cache hit
        results["awake"] = {"first": warm, "total": warm}
        for level in (1, 2):
            results[f"sleep{level}"] = from_sleep(engine, level)
    finally:
        engine.stop()
    print(f"load after: {os.getloadavg()[0]:.2f} (1 min)")
    for name, r in results.items():
        print(line(name, r))
    print(f"fetch: {size / 2**20:.0f} MiB copied locally in {fetch:.2f}s; a download at 1 Gbit/s would take "
          f"{size * 8 / 1e9:.2f}s instead")
    same = all(r["answer"] == before for k, r in results.items() if k.startswith("sleep"))
    print(f"greedy answer after each wake-up identical to before the sleep: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
