"""`shoal-engine bench serve`: a load generator for a running OpenAI-compatible server (like `vllm bench serve`).

Requests arrive as a Poisson process (or at a fixed rate, or all at once with --request-rate inf), under an
optional concurrency cap. Prompts are seeded synthetic text whose token lengths follow a uniform distribution
around --input-len (±--range-ratio); output lengths likewise, with ignore_eos so they are honoured. Every request
streams; TTFT is the time to the first content chunk, inter-token latency the gaps between chunks spread over the
tokens they carry. Prints request throughput, output tokens/s, TTFT/ITL/E2E percentiles and errors; --json for a
machine-readable result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

_WORDS = ("the quick brown fox jumps over lazy dog paged cache keeps keys values fixed size blocks continuous "
          "batching lets requests join leave running batch every step engine loop kubernetes runs pods nodes "
          "operator reconciles custom resources shoal fish swam together warm quiet sea hello world").split()


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None, help="bearer key (default: $SHOAL_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once)")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="inter-arrival times: exponential (Poisson process) or constant 1/rate")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean output length in tokens")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len*(1-r), len*(1+r)] (0: fixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS so output lengths are honoured)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps} | {"mean": None}
    s = sorted(values)
    out: dict[str, float | None] = {}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    out["mean"] = sum(s) / len(s)
    return out


def sample_lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_words)))


def arrival_delays(rng: random.Random, n: int, rate: float, arrival: str) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    if arrival == "fixed":
        return [1.0 / rate] * n
    return [rng.expovariate(rate) for _ in range(n)]


async def _tokens_per_word(session, base: str, model: str, headers: dict) -> float:
    """Calibrate the synthetic text's tokens per word with /tokenize (falls back to 1.3)."""
    sample = make_prompt(random.Random(1234), 200)
    try:
        async with session.post(base + "/tokenize", json={"model": model, "prompt": sample},
                                headers=headers) as r:
            if r.status == 200:
                return max(0.1, (await r.json())["count"] / 200)
    except Exception:  # noqa: BLE001
        pass
    return 1.3


async def _one(session, url: str, body: dict, headers: dict, chat: bool, timeout: float) -> RequestResult:
    import aiohttp

    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            buf = b""
            async for raw in r.content:
                buf += raw
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = msg["error"].get("message", "stream error")
                        return res
                    now = time.perf_counter()
                    if msg.get("usage"):
                        res.prompt_tokens = msg["usage"]["prompt_tokens"]
                        res.output_tokens = msg["usage"]["completion_tokens"]
                    for ch in msg.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if not text:
                            continue
                        if res.ttft is None:
                            res.ttft = now - start
                        elif last is not None:
                            res.itls.append(now - last)
                        last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def bench(args: argparse.Namespace) -> dict:
    import os

    import aiohttp

    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key = args.api_key or os.environ.get("SHOAL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model
        if model is None:
            async with session.get(base + "/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        tpw = await _tokens_per_word(session, base, model, headers)
        rng = random.Random(args.seed)
        in_lens = sample_lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
        out_lens = sample_lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
        prompts = [make_prompt(rng, round(n / tpw)) for n in in_lens]
        delays = arrival_delays(rng, args.num_prompts, args.request_rate, args.arrival)
        chat = args.endpoint == "chat"
        url = base + ("/v1/chat/completions" if chat else "/v1/completions")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def run_one(i: int) -> RequestResult:
            body = {"model": model, "max_tokens": out_lens[i], "temperature": args.temperature, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
            if chat:
                body["messages"] = [{"role": "user", "content": prompts[i]}]
            else:
                body["prompt"] = prompts[i]
            if sem is None:
                return await _one(session, url, body, headers, chat, args.timeout)
            async with sem:
                return await _one(session, url, body, headers, chat, args.timeout)

        tasks = []
        t0 = time.perf_counter()
        for i in range(args.num_prompts):
            if delays[i]:
                await asyncio.sleep(delays[i])
            tasks.append(asyncio.create_task(run_one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(args, model, results, duration)


def summarize(args, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itls = []
    for r in ok:
        # A chunk may carry several tokens; spread its gap over them (ITL per output token, like vLLM's TPOT).
        itls.extend(r.itls)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    ms = lambda d: {k: (None if v is None else round(v * 1000, 2)) for k, v in d.items()}  # noqa: E731
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": len(results),
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "arrival": args.arrival,
        "max_concurrency": args.max_concurrency,
        "duration_s": round(duration, 3),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3) if duration else None,
        "output_throughput": round(out_tokens / duration, 2) if duration else None,
        "ttft_ms": ms(percentiles([r.ttft for r in ok if r.ttft is not None])),
        "itl_ms": ms(percentiles(itls)),
        "tpot_ms": ms(percentiles(tpot)),
        "e2e_latency_ms": ms(percentiles([r.latency for r in ok])),
    }


def print_table(res: dict) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    rows = [
        ("Model", res["model"]), ("Endpoint", res["endpoint"]),
        ("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
        ("Benchmark duration (s)", res["duration_s"]),
        ("Total input tokens", res["total_input_tokens"]), ("Total generated tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
    ]
    for k, v in rows:
        print(f"{k:<40}{v}")
    for title, key in (("Time to First Token", "ttft_ms"), ("Inter-token Latency", "itl_ms"),
                       ("Time per Output Token (excl. 1st)", "tpot_ms"), ("End-to-end Latency", "e2e_latency_ms")):
        print("-" * 22 + f" {title} " + "-" * max(0, 42 - len(title)))
        for p in ("mean", "p50", "p90", "p99"):
            print(f"{p + ' (ms)':<40}{res[key][p]}")
    if res["errors"]:
        print("-" * 30 + " Errors " + "-" * 30)
        for e, n in res["errors"].items():
            print(f"{n:>6} x {e}")
    print("=" * 66)


def run_bench(args: argparse.Namespace) -> int:
    import aiohttp

    try:
        res = asyncio.run(bench(args))
    except (aiohttp.ClientError, OSError, KeyError, IndexError) as e:
        print(f"bench serve: cannot use the server at {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(res, sys.stdout)
        print()
    else:
        print_table(res)
    return 0 if res["completed"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="shoal-engine bench serve")
    add_bench_serve_args(p)
    return run_bench(p.parse_args(argv))


__all__ = ["add_bench_serve_args", "bench", "main", "percentiles", "run_bench", "RequestResult"]
