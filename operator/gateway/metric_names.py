"""What each engine runtime calls its load gauges, and where it says it is ready.

The gateway's poller and the operator's autoscaler read an engine's load from its Prometheus text; the names
differ per engine, the meanings do not. One `EngineMetrics` per runtime, keyed by the InferenceService's
`spec.runtime` (the operator passes it to shoal-gateway as `--runtime`). A runtime that has no gauge for one of
these keeps it at zero (e.g. SGLang publishes no waiting-prefill-tokens gauge): routing and scaling then use the
others. Only the standard library here: the gateway image has no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineMetrics:
    runtime: str
    ready_path: str  # 200 = may take new requests (the gateway's readiness poll)
    running: tuple[str, ...]  # sample names; the first one an engine publishes is read, summed over label sets
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # a fraction (1.0 = full); max over label sets
    waiting_prefill_tokens: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()  # counters (for dashboards and benches; not used to route)
    prefix_hits: tuple[str, ...] = ()
    lora_info: tuple[str, ...] = ()  # an info gauge labelled with running/waiting adapters and max_lora
    # an info gauge labelled with the adapters loaded (resident_lora_adapters) and max_cpu_lora; a runtime without
    # one (vLLM) counts the adapters its lora_info names as resident: a request runs or waits on each of them there
    lora_resident: tuple[str, ...] = ()
    # its /v1/models lists the LoRA adapters it serves (cards with a `parent`): the gateway routes by that list
    lists_adapters: bool = False


SHOAL = EngineMetrics(
    runtime="shoal", ready_path="/readyz",
    running=("shoal:num_requests_running",), waiting=("shoal:num_requests_waiting",),
    kv_usage=("shoal:kv_cache_usage_perc",), waiting_prefill_tokens=("shoal:num_waiting_prefill_tokens",),
    prefix_queries=("shoal:prefix_cache_queries_total",), prefix_hits=("shoal:prefix_cache_hits_total",),
    lora_info=("shoal:lora_requests_info",), lora_resident=("shoal:lora_resident_info",), lists_adapters=True,
)
VLLM = EngineMetrics(
    # vLLM's /health is 200 once the engine serves and while its engine core is alive (it listens only when
    # loaded); kv_cache_usage_perc is the V1 name, gpu_cache_usage_perc the V0 one (still read for old images).
    runtime="vllm", ready_path="/health",
    running=("vllm:num_requests_running",), waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_queries=("vllm:prefix_cache_queries_total",), prefix_hits=("vllm:prefix_cache_hits_total",),
    lora_info=("vllm:lora_requests_info",), lists_adapters=True,
)
SGLANG = EngineMetrics(
    runtime="sglang", ready_path="/health",
    running=("sglang:num_running_reqs",), waiting=("sglang:num_queue_reqs",), kv_usage=("sglang:token_usage",),
)
BY_RUNTIME = {m.runtime: m for m in (SHOAL, VLLM, SGLANG)}
RUNTIMES = tuple(BY_RUNTIME)


def for_runtime(runtime: str) -> EngineMetrics:
    try:
        return BY_RUNTIME[runtime]
    except KeyError:
        raise ValueError(f"unknown engine runtime {runtime!r} (known: {', '.join(RUNTIMES)})") from None


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float:
    for name in names:
        if name in sums:
            return sums[name]
    return 0.0


def load_from_sums(sums: dict[str, float], metrics: EngineMetrics) -> dict[str, float]:
    """{running, waiting, kv_usage, waiting_prefill_tokens} from {sample name: value summed over label sets}."""
    return {"running": _first(sums, metrics.running), "waiting": _first(sums, metrics.waiting),
            "kv_usage": _first(sums, metrics.kv_usage),
            "waiting_prefill_tokens": _first(sums, metrics.waiting_prefill_tokens)}


def scan(text: str, metrics: EngineMetrics) -> dict[str, float]:
    """The load gauges from Prometheus text with a line scan (no full parse: the gateway does this 4× a second
    per engine). Values are summed over label sets, except KV usage: the max (one engine, one cache)."""
    wanted = {name: key for key, names in (("running", metrics.running), ("waiting", metrics.waiting),
                                            ("kv_usage", metrics.kv_usage),
                                            ("waiting_prefill_tokens", metrics.waiting_prefill_tokens))
              for name in names}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value != value:  # NaN
            continue
        found[name] = max(found.get(name, 0.0), value) if wanted[name] == "kv_usage" else found.get(name, 0.0) + value
    return load_from_sums(found, metrics)
