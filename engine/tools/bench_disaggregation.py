"""Prefill/decode disaggregation against one aggregated engine at the same total cores: a long-prompt workload's
time to first token, inter-token latency and throughput. Prints numbers; not a test.

    python -m shoal.engine.tools.bench_disaggregation [--preset bench] [--requests 16] [--concurrency 4]
        [--prompt-len 768] [--output-len 32] [--cores 0,1]

Two layouts of the same `shoal-engine serve` on the same cores, each request sent to both in turn (alternating
which goes first, so a busy machine slows them alike):
  - aggregated: one engine on every core of --cores (OMP threads = cores);
  - disaggregated: a prefill engine (kv_producer) on the first half of the cores and a decode engine
    (kv_consumer) on the other half, driven as the gateway drives them: the prefill request (max_tokens 1,
    kv_transfer_params do_remote_decode), then the streamed request to the decode engine with the prefill's
    kv_transfer_params, which pulls the prompt's KV.
Every prompt is new (random token ids), so no prefix cache helps either layout. TTFT counts from the client's
first byte sent (for disaggregation the prefill round trip and the KV pull are inside it); ITL is the gap between
streamed tokens. Concurrency --concurrency: while one request prefills, others decode, which is where an
aggregated engine's decode steps stall behind prefill chunks and a disaggregated decode engine's do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, cores: list[int], role: str | None, extra: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model, "--served-model-name", "m",
                "--host", "127.0.0.1", "--port", str(self.port), *extra]
        if role is not None:
            args += ["--kv-transfer-config", json.dumps({"kv_connector": "ShoalConnector", "kv_role": role})]
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
        self.log = tempfile.NamedTemporaryFile("w", prefix="bench-pd-", suffix=".log", delete=False)
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *args] if _has_taskset() else args
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=tempfile.gettempdir())

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited; see {self.log.name}")
            try:
                async with session.get(self.url + "/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.url} not ready; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


async def _stream(session, url: str, body: dict, started: float) -> tuple[float, list[float], int]:
    """(TTFT from `started`, the inter-token gaps, tokens) of one streamed completion."""
    first, last, gaps, n = None, None, [], 0
    # logprobs: a chunk per token even where the token's text is empty (a random model's byte pieces)
    async with session.post(url + "/v1/completions", json={**body, "stream": True, "logprobs": 0}) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [None])[0]
            tokens = len(((choice or {}).get("logprobs") or {}).get("tokens") or [])
            if not tokens:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - started
            else:
                gaps.append((now - last) / tokens)
            last, n = now, n + tokens
    return first, gaps, n


async def aggregated(session, engine: Server, body: dict):
    return await _stream(session, engine.url, body, time.perf_counter())


async def disaggregated(session, prefill: Server, decode: Server, body: dict):
    started = time.perf_counter()
    async with session.post(prefill.url + "/v1/completions", json={
            **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}) as r:
        r.raise_for_status()
        params = (await r.json())["kv_transfer_params"]
    return await _stream(session, decode.url, {**body, "kv_transfer_params": params}, started)


async def run(args) -> dict:
    from shoal.engine.tools.bench_throughput import bench_model_dir

    model = str(bench_model_dir(args.preset))
    cores = [int(c) for c in args.cores.split(",")]
    half = max(1, len(cores) // 2)
    extra = ["--max-model-len", str(args.prompt_len + args.output_len + 16), "--dtype", args.dtype]
    servers = {"aggregated": Server(model, cores, None, extra),
               "prefill": Server(model, cores[:half], "kv_producer", extra),
               "decode": Server(model, cores[half:] or cores, "kv_consumer", extra)}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    results = {name: {"ttft": [], "itl": [], "tokens": 0, "seconds": 0.0} for name in ("aggregated", "disaggregated")}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
            for s in servers.values():
                await s.wait_ready(session)
            layouts = {"aggregated": lambda b: aggregated(session, servers["aggregated"], b),
                       "disaggregated": lambda b: disaggregated(session, servers["prefill"], servers["decode"], b)}
            warm = {"prompt": prompts[0][:32], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            for fn in layouts.values():
                await fn(warm)
            order = list(layouts)
            for round_ in range(args.rounds):
                for name in (order if round_ % 2 == 0 else order[::-1]):
                    sem = asyncio.Semaphore(args.concurrency)

                    async def one(p, name=name, sem=sem):
                        async with sem:
                            return await layouts[name]({"prompt": p, "max_tokens": args.output_len,
                                                        "temperature": 0, "ignore_eos": True})

                    started = time.perf_counter()
                    outs = await asyncio.gather(*(one(p) for p in prompts))
                    r = results[name]
                    r["seconds"] += time.perf_counter() - started
                    for ttft, gaps, n in outs:
                        r["ttft"].append(ttft)
                        r["itl"] += gaps
                        r["tokens"] += n
            async with session.get(servers["decode"].url + "/metrics") as r:  # the KV came over, not recomputed
                text = await r.text()
                results["decode_engine"] = {
                    "pulled": _counter(text, 'shoal:kv_transfer_blocks_total{direction="pulled"'),
                    "fallbacks": _counter(text, "shoal:kv_transfer_fallbacks_total")}
    finally:
        for s in servers.values():
            s.stop()
    return results


def _counter(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"prefill/decode disaggregation vs aggregated, preset {args.preset}, {args.requests} requests x "
          f"{args.rounds} rounds, prompts {args.prompt_len}, outputs {args.output_len}, concurrency "
          f"{args.concurrency}, cores {args.cores}")
    pulled = res.pop("decode_engine")
    for name, r in res.items():
        print(f"  {name:14s} TTFT p50 {1000 * statistics.median(r['ttft']):8.1f} ms  p90 "
              f"{1000 * _pct(r['ttft'], 0.9):8.1f} ms   ITL p50 {1000 * statistics.median(r['itl']):6.1f} ms  "
              f"p90 {1000 * _pct(r['itl'], 0.9):6.1f} ms   {r['tokens'] / r['seconds']:7.1f} output tok/s")
    print(f"  decode engine: {pulled['pulled']:.0f} KV blocks pulled, {pulled['fallbacks']:.0f} local prefills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
