"""`python -m shoal.operator.gateway.bench_shared`: the shared gateway's routing cost at scale, fairness under a flood.

Two parts (`--parts`):
  pick      in-process: a shared gateway fed `--models` InferenceServices with `--adapters-per-model` adapters each
            (2 engines per service, some adapters resident), then `--picks` requests for names drawn uniformly from
            every base model and adapter. Printed: the time to find the service and pick an engine (model lookup +
            router; prompt hashing apart), and the memory the gateway's structures take (tracemalloc), before and
            after the prefix index filled up.
  fairness  real processes: one engine (a small random Llama) behind shoal-gateway, tenant A flooding it with long
            prompts from `--flood-clients` closed-loop clients while tenant B sends a trickle of short streamed
            requests. B's TTFT unloaded and under the flood, and A's completed requests, with fairness off (the
            gateway forwards everything; the engine queues first come, first served) and on
            (`--max-inflight-per-engine` slots and tenants from a header: start-time fair queuing in the gateway,
            and each request's engine priority from its tenant's requests already at the engine, which the engine,
            run with --scheduling-policy priority, serves first). Rounds alternate off/on (`--rounds`), so a
            loaded machine hurts both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import sys
import time
import tracemalloc

import aiohttp

from shoal.operator.gateway.bench_fleet import Child, _bench_model, _pct


def add_bench_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="pick,fairness", help="comma-separated: pick, fairness")
    p.add_argument("--models", type=int, default=100)
    p.add_argument("--adapters-per-model", type=int, default=10)
    p.add_argument("--tenants", type=int, default=50,
                   help="pick: tenants, each in its namespace holding a share of the services (granted to all), "
                        "with per-tenant quotas on; 0: one anonymous tenant, no quotas")
    p.add_argument("--picks", type=int, default=20000)
    p.add_argument("--prompt-chars", type=int, default=2000, help="pick: prompt length (prefix hashing)")
    p.add_argument("--model", default=None, help="fairness: model directory (default: a small random Llama)")
    p.add_argument("--flood-clients", type=int, default=8)
    p.add_argument("--flood-chars", type=int, default=3000, help="tenant A's prompt length (about 2,000 tokens)")
    p.add_argument("--flood-tokens", type=int, default=16)
    p.add_argument("--trickle-requests", type=int, default=20)
    p.add_argument("--trickle-interval", type=float, default=0.25)
    p.add_argument("--slots", type=int, default=16, help="fairness on: --max-inflight-per-engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the engine's token budget per step: the longest step a trickle request may wait for")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--json", action="store_true")


# ---- pick ----------------------------------------------------------------------------------------------------------
def _isvc(i: int, adapters: int, tenants: int) -> dict:
    from shoal.operator.gateway.fleet import GRANT_ANNOTATION

    namespace = f"team-{i % tenants}" if tenants else "bench"
    return {"metadata": {"namespace": namespace, "name": f"svc-{i}", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "annotations": {GRANT_ANNOTATION: "*"}},
            "spec": {"model": {"uri": f"hf://org/model-{i}", "servedName": f"model-{i}"},
                     "adapters": [{"name": f"model-{i}-lora-{j}", "uri": f"hf://org/lora-{i}-{j}"}
                                  for j in range(adapters)]}}


def _fleet(args):
    """A shared gateway fed the fleet, its engines fresh and ready; -> (gateway, every model name)."""
    from shoal.operator.gateway.proxy import Gateway, GatewayConfig
    from shoal.operator.gateway.quotas import QuotaPolicy

    # quotas on, set high enough never to refuse: the cost of keeping the buckets is what is measured
    quotas = QuotaPolicy(10**9, 10**12, 10**6) if args.tenants else QuotaPolicy()
    gw = Gateway(GatewayConfig(quotas=quotas), namespace="bench", shared=True)
    fleet = gw.pools
    fleet.reset([_isvc(i, args.adapters_per_model, args.tenants) for i in range(args.models)])
    now = time.monotonic()
    for i, pool in enumerate(fleet.all()):
        pool.backends.replace([f"http://10.{i // 250}.{i % 250}.{k}:8000" for k in (1, 2)])
        for k, b in enumerate(pool.backends.all()):
            b.ready, b.last_answer, b.last_ok = True, now, now
            b.served_model, b.max_cpu_loras = pool.served_name, 4
            b.lora_resident = frozenset(f"{pool.served_name}-lora-{j}" for j in range(k * 4, k * 4 + 4))
    return gw, sorted(fleet.index())


def _picks(gw, names: list[str], args, times: list[float] | None = None, hash_times: list[float] | None = None):
    from shoal.operator.gateway.admission import Ticket

    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(args.prompt_chars)) for _ in range(64)]
    for n in range(args.picks):
        model = rng.choice(names)
        body = {"model": model, "prompt": prompts[n % len(prompts)] + str(n)}
        tenant = f"team-{n % args.tenants}" if args.tenants else None
        t0 = time.perf_counter()
        pool = gw.pools.resolve(model, tenant)  # the tenant's own namespace first, then those granting it
        if tenant is not None:
            gw.quotas.admit(tenant, 1000.0)
        t1 = time.perf_counter()
        hashes = gw.prompt_hashes("/v1/completions", body, model, pool)
        t2 = time.perf_counter()
        ticket = Ticket(model=model, hashes=hashes, tenant=tenant or "")
        backend = pool.pick(ticket)
        t3 = time.perf_counter()
        pool.release(backend, ticket)
        if tenant is not None:
            gw.quotas.release(tenant)
        if times is not None:
            times.append((t1 - t0) + (t3 - t2))
            hash_times.append(t2 - t1)


async def bench_pick(args) -> dict:
    # memory first (tracemalloc slows every allocation down), then the timing on a fresh fleet without it; the
    # modules are imported before, so only data is counted
    for module in ("fleet", "proxy", "wake"):
        importlib.import_module(f"shoal.operator.gateway.{module}")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    gw, names = _fleet(args)
    loaded = tracemalloc.take_snapshot()
    _picks(gw, names, args)
    filled = tracemalloc.take_snapshot()
    tracemalloc.stop()
    index_hashes = len(gw.prefix_index.index)
    del gw

    def mib(a, b) -> float:
        return sum(s.size_diff for s in b.compare_to(a, "filename")) / 2**20

    gw, names = _fleet(args)
    times: list[float] = []
    hash_times: list[float] = []
    _picks(gw, names, args, times, hash_times)
    return {"models": args.models, "adapters": args.models * args.adapters_per_model, "names": len(names),
            "tenants": args.tenants,
            "picks": args.picks, "pick_p50_us": _pct(times, 50) * 1e6, "pick_p99_us": _pct(times, 99) * 1e6,
            "pick_mean_us": sum(times) / len(times) * 1e6, "hash_p50_us": _pct(hash_times, 50) * 1e6,
            "memory_fleet_mib": mib(before, loaded), "memory_after_picks_mib": mib(before, filled),
            "prefix_index_hashes": index_hashes}


# ---- fairness ----------------------------------------------------------------------------------------------------
def _words(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice("alpha bravo cedar delta ember fjord gravel harbor island jetty kelp lagoon".split())
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def _ttft(session, url: str, tenant: str, prompt: str, max_tokens: int) -> float | None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers={"X-Tenant": tenant}) as r:
        if r.status != 200:
            await r.read()
            return None
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
        return first


async def _trickle(session, url: str, args, rng: random.Random) -> list[float]:
    out = []
    for i in range(args.trickle_requests):
        t = await _ttft(session, url, "b", f"question {i}: {_words(rng, 120)}", 4)
        if t is not None:
            out.append(t)
        await asyncio.sleep(args.trickle_interval)
    return out


async def _round(session, url: str, args, rng: random.Random) -> dict:
    unloaded = await _trickle(session, url, args, rng)
    stop = asyncio.Event()
    done = {"a": 0, "errors": 0}

    async def flood(k: int):
        while not stop.is_set():
            t = await _ttft(session, url, "a", f"{k} {rng.random()} " + _words(rng, args.flood_chars),
                            args.flood_tokens)
            done["a" if t is not None else "errors"] += 1

    clients = [asyncio.create_task(flood(k)) for k in range(args.flood_clients)]
    await asyncio.sleep(2.0)  # the flood fills the engine first
    started = time.perf_counter()
    a0 = done["a"]
    loaded = await _trickle(session, url, args, rng)
    seconds = time.perf_counter() - started
    a_done = done["a"] - a0
    stop.set()
    await asyncio.gather(*clients)
    return {"b_unloaded": unloaded, "b_flood": loaded, "a_per_s": a_done / seconds, "errors": done["errors"]}


async def bench_fairness(args) -> dict:
    model = args.model or _bench_model()
    # One engine scheduling by priority: the "off" gateway sends none (all equal: first come, first served), the
    # "on" one admits by tenant and sends each request its tenant's rank at the engine.
    engine = Child([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model, "--served-model-name",
                    "tiny", "--kv-cache-memory", args.kv_cache_memory, "--scheduling-policy", "priority",
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "warning"])
    base = [sys.executable, "-m", "shoal.operator.gateway", "--endpoint", engine.url, "--log-level", "warning",
            "--tenant-header", "X-Tenant", "--poll-interval", "0.1"]
    gateways = {"off": Child(base),
                "on": Child([*base, "--max-inflight-per-engine", str(args.slots), "--engine-priority"])}
    results: dict[str, list[dict]] = {"off": [], "on": []}
    rng = random.Random(1)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for c in (engine, *gateways.values()):
                await c.wait_ready(session)
            await _ttft(session, engine.url, "warm", "warm up " * 50, 2)
            for r in range(args.rounds):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    results[mode].append(await _round(session, gateways[mode].url, args, rng))
    finally:
        for c in (*gateways.values(), engine):
            c.stop()
    out = {}
    for mode, rounds in results.items():
        unloaded = [t for r in rounds for t in r["b_unloaded"]]
        flood = [t for r in rounds for t in r["b_flood"]]
        out[mode] = {"b_unloaded_p50_ms": _pct(unloaded, 50) * 1e3, "b_unloaded_p95_ms": _pct(unloaded, 95) * 1e3,
                     "b_flood_p50_ms": _pct(flood, 50) * 1e3, "b_flood_p95_ms": _pct(flood, 95) * 1e3,
                     "a_requests_per_s": sum(r["a_per_s"] for r in rounds) / len(rounds),
                     "errors": sum(r["errors"] for r in rounds)}
    return out


async def main_async(args) -> int:
    parts = [p for p in args.parts.split(",") if p]
    report = {"load": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None}
    if "pick" in parts:
        report["pick"] = await bench_pick(args)
    if "fairness" in parts:
        report["fairness"] = await bench_fairness(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "pick" in report:
        p = report["pick"]
        print(f"pick: {p['models']} models, {p['adapters']} adapters ({p['names']} names), {p['tenants']} tenants "
              f"(quotas {'on' if p['tenants'] else 'off'}), {p['picks']} picks: "
              f"lookup + route p50 {p['pick_p50_us']:.1f} us, p99 {p['pick_p99_us']:.1f} us, mean "
              f"{p['pick_mean_us']:.1f} us (prompt hashing apart: p50 {p['hash_p50_us']:.1f} us); memory "
              f"{p['memory_fleet_mib']:.1f} MiB for the fleet, {p['memory_after_picks_mib']:.1f} MiB with the "
              f"prefix index ({p['prefix_index_hashes']} hashes)")
    if "fairness" in report:
        for mode, f in report["fairness"].items():
            print(f"fairness {mode:>3}: B TTFT unloaded p50/p95 {f['b_unloaded_p50_ms']:.0f}/"
                  f"{f['b_unloaded_p95_ms']:.0f} ms, under A's flood {f['b_flood_p50_ms']:.0f}/"
                  f"{f['b_flood_p95_ms']:.0f} ms; A {f['a_requests_per_s']:.2f} req/s; errors {f['errors']}")
    print(f"load average at start: {report['load']}")
    return 0


def run_bench(args) -> int:
    return asyncio.run(main_async(args))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.operator.gateway.bench_shared", description=__doc__.split("\n")[0])
    add_bench_gateway_args(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
