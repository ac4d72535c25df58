"""`python -m shoal.operator.gateway.bench_batch`: interactive chat beside a running batch job.

Real processes: one engine (a small random Llama, or `--model`) behind `shoal-gateway --batch-dir` with
`--max-inflight-per-engine --slots`. `--clients` closed-loop clients send streamed chats for `--seconds`, once with
no batch and once while a batch of `--batch-requests` chats runs through the same gateway (submitted just before,
cancelled just after), rounds alternating (`--rounds`) so a loaded machine hurts both sides alike. With
`--engine-priority` the engine schedules by priority and the gateway sends batch requests at the lowest;
`--batch-share idle|spare` is the gateway's policy (idle: batch requests only while no interactive request is in
flight at the engine; with closed-loop clients that is rarely, so few batch requests finish). Printed per
side: interactive TTFT p50/p95, interactive requests and output tokens per second, and the batch requests that
finished meanwhile; then the ratios (the goal: TTFT within 10 % of no batch). The machine's load average is
printed with them: on a shared machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import sys
import tempfile
import time

import aiohttp

from shoal.operator.gateway.bench_fleet import Child, _bench_model, _pct


async def _chat(session, url: str, prompt: str, max_tokens: int) -> tuple[float, int] | None:
    """(TTFT seconds, output chunks) of one streamed chat, or None when it failed."""
    started = time.perf_counter()
    ttft, chunks = None, 0
    body = {"model": "tiny", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return None
        async for raw in r.content:
            if raw.startswith(b"data: {") and b'"content"' in raw:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
    return (ttft, chunks) if ttft is not None else None


async def _interactive(session, url: str, args, rng: random.Random) -> dict:
    ttfts: list[float] = []
    tokens, failed = 0, 0
    deadline = time.perf_counter() + args.seconds

    async def client(k: int):
        nonlocal tokens, failed
        while time.perf_counter() < deadline:
            prompt = f"user {k} asks {rng.random():.6f}: " + " ".join(rng.choice(WORDS) for _ in range(args.words))
            got = await _chat(session, url, prompt, args.max_tokens)
            if got is None:
                failed += 1
            else:
                ttfts.append(got[0])
                tokens += got[1]

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(args.clients)))
    elapsed = time.perf_counter() - started
    return {"ttft_p50_ms": _pct(ttfts, 50) * 1000, "ttft_p95_ms": _pct(ttfts, 95) * 1000,
            "requests_per_s": len(ttfts) / elapsed, "tokens_per_s": tokens / elapsed, "failed": failed,
            "requests": len(ttfts)}


WORDS = "the a fleet of engines serves many requests while batches run below them at the lowest priority".split()


async def _submit_batch(session, url: str, args, rng: random.Random) -> str:
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "tiny", "max_tokens": args.batch_max_tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"batch {i} {rng.random():.6f}: " +
                                                " ".join(rng.choice(WORDS) for _ in range(args.words))}]}})
             for i in range(args.batch_requests)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO("\n".join(lines).encode()), filename="batch.jsonl")
    async with session.post(url + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    async with session.post(url + "/v1/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                                       "endpoint": "/v1/chat/completions"}) as r:
        return (await r.json())["id"]


async def _batch_done(session, url: str, batch_id: str) -> int:
    async with session.get(f"{url}/v1/batches/{batch_id}") as r:
        return (await r.json())["request_counts"]["completed"]


async def main_async(args) -> int:
    model_dir = args.model or _bench_model()
    batch_dir = tempfile.mkdtemp(prefix="shoal-bench-batch-")
    engine = Child([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model_dir, "--served-model-name",
                    "tiny", "--kv-cache-memory", args.kv_cache_memory,
                    *(["--scheduling-policy", "priority"] if args.engine_priority else [])])
    gateway = Child([sys.executable, "-m", "shoal.operator.gateway", "--endpoint", engine.url, "--poll-interval",
                     "0.1", "--log-level", "warning", "--max-inflight-per-engine", str(args.slots),
                     "--batch-dir", batch_dir, "--batch-max-inflight-per-engine", str(args.batch_per_engine),
                     "--batch-share", args.batch_share,
                     *(["--engine-priority"] if args.engine_priority else [])])
    rng = random.Random(0)
    sides: dict[str, list[dict]] = {"no batch": [], "batch": []}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await engine.wait_ready(session)
            await gateway.wait_ready(session, 60)
            await _interactive(session, gateway.url, argparse.Namespace(**{**vars(args), "seconds": 3}), rng)  # warm
            for _ in range(args.rounds):
                sides["no batch"].append(await _interactive(session, gateway.url, args, rng))
                batch_id = await _submit_batch(session, gateway.url, args, rng)
                before = await _batch_done(session, gateway.url, batch_id)
                result = await _interactive(session, gateway.url, args, rng)
                result["batch_done"] = await _batch_done(session, gateway.url, batch_id) - before
                sides["batch"].append(result)
                async with session.post(f"{gateway.url}/v1/batches/{batch_id}/cancel") as r:
                    await r.read()
    finally:
        gateway.stop()
        engine.stop()
    load = os.getloadavg()
    report = {}
    for side, runs in sides.items():
        report[side] = {k: sum(r.get(k, 0) for r in runs) / len(runs)
                        for k in ("ttft_p50_ms", "ttft_p95_ms", "requests_per_s", "tokens_per_s", "failed",
                                  "batch_done")}
    if args.json:
        print(json.dumps({**report, "loadavg": load}, indent=2))
        return 0
    print(f"{args.clients} interactive clients, {args.slots} slots, "
          f"engine scheduling {'priority' if args.engine_priority else 'fcfs'}, batch of {args.batch_requests} "
          f"({args.batch_per_engine} per engine, share {args.batch_share}), "
          f"{args.rounds} x {args.seconds:g} s per side; "
          f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} CPUs")
    for side, r in report.items():
        print(f"{side:>8}: TTFT p50/p95 {r['ttft_p50_ms']:.0f}/{r['ttft_p95_ms']:.0f} ms, "
              f"{r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} tok/s, failed {r['failed']:.0f}, "
              f"batch requests done {r['batch_done']:.1f} per run")
    a, b = report["no batch"], report["batch"]
    print(f"   ratio: TTFT p50 x{b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}, "
          f"p95 x{b['ttft_p95_ms'] / a['ttft_p95_ms']:.2f}, "
          f"throughput x{b['tokens_per_s'] / a['tokens_per_s']:.2f} (goal: TTFT within x1.10)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.operator.gateway.bench_batch", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: a small random Llama)")
    p.add_argument("--clients", type=int, default=4, help="closed-loop interactive clients")
    p.add_argument("--slots", type=int, default=8, help="the gateway's --max-inflight-per-engine")
    p.add_argument("--batch-per-engine", type=int, default=2, help="--batch-max-inflight-per-engine")
    p.add_argument("--batch-requests", type=int, default=200)
    p.add_argument("--batch-share", choices=("idle", "spare"), default="idle", help="the gateway's --batch-share")
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16, help="interactive answers' length")
    p.add_argument("--words", type=int, default=60, help="words per prompt")
    p.add_argument("--seconds", type=float, default=15.0, help="per side and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--engine-priority", action="store_true",
                   help="the engine runs --scheduling-policy priority and the gateway sends priorities "
                        "(--engine-priority): interactive prefills go before the batch's")
    p.add_argument("--json", action="store_true")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
