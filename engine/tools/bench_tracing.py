"""What tracing costs chat traffic: the same `bench serve` chat workload against a server with tracing off and one
exporting every request's spans over OTLP/HTTP (to a collector in this process that counts and drops them).
Prints output tok/s, request/s and TTFT p50/p90/p99 for both, and the spans the collector received.

    python -m shoal.engine.tools.bench_tracing [--model DIR] [--num-prompts 64] [--max-concurrency 8]

Without --model a tiny random-weight Llama is made (what is measured is then the server's overhead, not a model's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Sink:
    """An OTLP/HTTP endpoint that counts export requests and bytes, and drops them."""

    def __init__(self):
        self.requests = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                sink.requests += 1
                sink.bytes += n
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, env: dict, args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model, "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_concurrency),
           "--disable-access-log", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("serve was not ready after 600 s")


def _measure(url: str, args) -> dict:
    from shoal.engine.tools.bench_serve import add_bench_serve_args, bench

    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    common = ["--base-url", url, "--endpoint", "chat", "--input-len", str(args.input_len), "--output-len",
              str(args.output_len), "--max-concurrency", str(args.max_concurrency)]
    asyncio.run(bench(p.parse_args(common + ["--num-prompts", str(args.max_concurrency)])))  # warm up
    return asyncio.run(bench(p.parse_args(common + ["--num-prompts", str(args.num_prompts), "--seed", "1"])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_tracing", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random-weight Llama)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from shoal.engine.tools.tiny_model import make_model

        model = str(make_model(tempfile.mkdtemp(prefix="bench-tracing-"), arch="llama"))
    sink = _Sink()
    rows = []
    for name, env in (("off", {}),
                      ("on", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink.port}/v1/traces"})):
        proc, url = _serve(model, env, args)
        try:
            rows.append((name, _measure(url, args)))
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"chat, {args.num_prompts} requests, {args.max_concurrency} concurrent, ~{args.input_len} in / "
          f"{args.output_len} out tokens")
    print(f"{'tracing':<8} {'out tok/s':>10} {'req/s':>8} {'TTFT p50 ms':>12} {'p90':>8} {'p99':>8} {'failed':>7}")
    for name, r in rows:
        t = r["ttft_ms"]
        print(f"{name:<8} {r['output_throughput']:>10.1f} {r['request_throughput']:>8.2f} {t['p50']:>12.1f} "
              f"{t['p90']:>8.1f} {t['p99']:>8.1f} {r['failed']:>7}")
    print(f"collector: {sink.requests} OTLP exports, {sink.bytes} bytes")
    return 0 if all(r["failed"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
