"""`shoal-engine demo`: start the server, stream one chat answer through the official openai client, stop.

The server runs as a subprocess (`python -m shoal.engine.cli serve ...`) on a free localhost port, exactly as it
runs in a pod; the demo waits for /readyz, streams the answer as it arrives, prints a few Prometheus metrics, then
sends SIGTERM and waits for the clean exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from shoal.engine.tools import demo_model

NOTE = ("Note: falling back to a tiny Llama with RANDOM weights, generated on first use - it proves the "
        "machinery (paged KV cache, batching, streaming, metrics), not language quality, so its answer is "
        "gibberish.\nServe a real model with: shoal-engine serve --model /path/to/hf-dir (or FILE.gguf)")


def offline() -> bool:
    """The user said there is no network (the Hugging Face convention, or Shoal's own switch)."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("SHOAL_OFFLINE", "HF_HUB_OFFLINE"))


def pick_demo_model(no_download: bool = False) -> tuple[str | None, str]:
    """(GGUF path or None for the random tiny model, a line saying what is served and why)."""
    found = demo_model.find_demo_model()
    if found is not None:
        return str(found), f"Serving {demo_model.MODEL_LABEL} from {found}"
    if no_download or offline():
        why = "--no-download was given" if no_download else "offline (SHOAL_OFFLINE/HF_HUB_OFFLINE is set)"
        return None, f"The demo model {demo_model.MODEL_LABEL} is not cached and {why}.\n{NOTE}"
    print(f"Fetching {demo_model.MODEL_LABEL} into {demo_model.cached_path().parent} (once, ~93 MB)", flush=True)
    try:
        path = demo_model.fetch_demo_model()
    except demo_model.DemoModelError as e:
        return None, f"Could not fetch the demo model: {e}\n{NOTE}"
    return str(path), f"Serving {demo_model.MODEL_LABEL} from {path}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    return False


def scrape(base: str) -> dict[str, float]:
    """{'name{labels}': value} from /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                pass
    return out


def metric(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def run_demo(args) -> int:
    try:
        from openai import OpenAI
    except ImportError:
        print("the demo needs the openai client: pip install 'shoal[demo]' (or pip install openai)", file=sys.stderr)
        return 1
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    extra = [a for a in (args.extra or []) if a != "--"]
    model, served = args.model, None
    if model is None:
        model, line = pick_demo_model(args.no_download)
        print(line, flush=True)
        if model is not None:
            served = "SmolLM2-135M-Instruct"
    else:
        print(f"Serving {model}", flush=True)
    cmd = [sys.executable, "-m", "shoal.engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--disable-access-log", *(["--model", model] if model else []),
           *(["--served-model-name", served, "--dtype", demo_model.DEMO_DTYPE] if served else []), *extra]
    print(f"Starting the server: shoal-engine {' '.join(cmd[3:])}", flush=True)
    log = tempfile.NamedTemporaryFile("w+", prefix="shoal-demo-", suffix=".log", delete=False)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.monotonic()
        if not wait_ready(base, proc, args.startup_timeout):
            log.flush()
            log.seek(0)
            print("the server did not become ready; its log:\n" + log.read()[-4000:], file=sys.stderr)
            return 1
        print(f"Server ready at {base} after {time.monotonic() - t0:.1f}s", flush=True)
        client = OpenAI(base_url=base + "/v1", api_key=os.environ.get("SHOAL_API_KEY", "not-needed"))
        model = client.models.list().data[0].id
        print(f"\nuser> {args.prompt}\n{model}> ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
            temperature=args.temperature, seed=0, stream=True, stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                usage = chunk.usage
        print("\n")
        if usage is not None:
            print(f"usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")
        m = scrape(base)
        n_ttft = metric(m, "shoal:time_to_first_token_seconds_count")
        ttft = metric(m, "shoal:time_to_first_token_seconds_sum") / max(n_ttft, 1)
        n_itl = metric(m, "shoal:inter_token_latency_seconds_count")
        itl = metric(m, "shoal:inter_token_latency_seconds_sum") / max(n_itl, 1)
        print("metrics (from /metrics):")
        print(f"  shoal:request_success_total      {metric(m, 'shoal:request_success_total'):.0f}")
        print(f"  shoal:prompt_tokens_total        {metric(m, 'shoal:prompt_tokens_total'):.0f}")
        print(f"  shoal:generation_tokens_total    {metric(m, 'shoal:generation_tokens_total'):.0f}")
        print(f"  time to first token (mean)       {ttft * 1000:.1f} ms")
        print(f"  inter-token latency (mean)       {itl * 1000:.1f} ms")
        print(f"  shoal:kv_cache_usage_perc        {metric(m, 'shoal:kv_cache_usage_perc'):.3f}")
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
                print(f"server stopped (exit code {code})")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        try:
            os.unlink(log.name)
        except OSError:
            pass

