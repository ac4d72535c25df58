"""Prometheus metrics under the `shoal:` prefix, with vLLM's meanings and a model_name label.

Engine-wide values (running/waiting requests, KV usage, preemptions, prefix cache, token totals) are read at
scrape time from the latest EngineStats snapshot the engine thread took, so the engine itself never touches
Prometheus. Per-request values (TTFT, inter-token latency, end-to-end latency, queue time, finished requests) are
observed by the AsyncEngine as outputs arrive. Every app gets its own CollectorRegistry (never the global one), so
several servers can live in one process (tests).

The same values are exported a second time under vLLM's names (`vllm:num_requests_running`, ...; see
VLLM_ALIASES) for tools that expect them: KEDA scalers, the Gateway API inference extension, production-stack
and AIBrix routers, existing Grafana dashboards. Shoal's own names stay the reference (its gateway and autoscaler
read `shoal:`); `vllm:gpu_cache_usage_perc` (vLLM V0's name for KV usage), `vllm:lora_requests_info` (the
adapters running and waiting with --enable-lora, none without) and `vllm:cache_config_info` (block size and block
count as labels) are there because such tools read them too: the inference extension's endpoint picker reads
vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:lora_requests_info and
vllm:cache_config_info by default.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.engine import startup
from shoal.engine.core.async_engine import AsyncEngine, MetricsSink
from shoal.engine.core.outputs import RequestOutput

PREFIX = "shoal:"

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]

FINISHED_REASONS = ("stop", "length", "abort")

VLLM_PREFIX = "vllm:"
# shoal: family -> the vllm: families with the same meaning (and type, labels and buckets)
VLLM_ALIASES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "lora_requests_info": ("lora_requests_info",),
    "cache_config_info": ("cache_config_info",),
}


class _EngineStatsCollector:
    """Gauges and counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        s = self.engine.snapshot.stats
        lbl = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(lbl, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(lbl, float(value))
            return c

        get = (lambda k: getattr(s, k, 0) or 0) if s is not None else (lambda k: 0)
        yield gauge("num_requests_running", "Number of requests in model execution batches.", get("num_running"))
        # Requests handed to the engine thread but not yet in its queue count as waiting too.
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", self.engine.num_waiting())
        yield gauge("num_waiting_prefill_tokens", "Prompt tokens of queued or prefilling requests not yet computed.",
                    get("num_waiting_prefill_tokens"))
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", get("kv_cache_usage"))
        yield gauge("num_kv_blocks", "Number of blocks in the KV-cache pool.", get("num_kv_blocks"))
        yield gauge("num_free_kv_blocks", "Number of free blocks in the KV-cache pool.", get("num_free_kv_blocks"))
        yield from self._cache_config(get("num_kv_blocks"))
        yield gauge("engine_healthy", "1 when the engine loop is alive.", 1.0 if self.engine.is_alive() else 0.0)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      get("num_preemptions_total"))
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      get("prefix_cache_queries_total"))
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      get("prefix_cache_hits_total"))
        yield counter("prompt_tokens", "Number of prefill tokens processed.", get("prompt_tokens_total"))
        yield counter("generation_tokens", "Number of generation tokens processed.", get("generation_tokens_total"))
        # Speculative decoding; acceptance rate = accepted / draft tokens.
        yield counter("spec_decode_num_drafts", "Number of spec decoding drafts (one per sequence and step).",
                      get("spec_decode_num_drafts_total"))
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", get("spec_decode_num_draft_tokens_total"))
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      get("spec_decode_num_accepted_tokens_total"))

        yield from self._lora(s)
        yield from self._kv_offload(s)
        yield self._startup()

    def _kv_offload(self, s):
        """KV offloading (--kv-offloading-size): prefix-cache hits per tier and each offload tier's fill. Absent when
        offloading is off."""
        hits = getattr(s, "prefix_cache_tier_hits", None)
        if not hits:
            return
        c = CounterMetricFamily(PREFIX + "prefix_cache_tier_hits", "Prefix cache hits by the tier that served "
                                "them (device: the KV cache itself; cpu, disk: offload tiers), in tokens.",
                                labels=["model_name", "tier"])
        for tier, tokens in hits.items():
            c.add_metric([self.model_name, tier], float(tokens))
        yield c
        families = {
            "blocks": ("kv_offload_blocks", "KV blocks held by each offload tier (rank 0's)."),
            "used_bytes": ("kv_offload_used_bytes", "Bytes of KV blocks held by each offload tier (rank 0's)."),
            "capacity_bytes": ("kv_offload_capacity_bytes", "Capacity of each offload tier in bytes (rank 0's)."),
            "pending": ("kv_offload_pending_blocks", "KV blocks copied out of the KV cache that the copy thread has "
                        "not yet handed to the tier (rank 0's); a backlog that keeps growing means the tier cannot "
                        "keep up."),
        }
        tiers = s.kv_offload_tiers
        for key, (name, doc) in families.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "tier"])
            for tier, values in tiers.items():
                g.add_metric([self.model_name, tier], float(values[key]))
            yield g
        bad = CounterMetricFamily(PREFIX + "kv_offload_corrupted_blocks", "Offloaded KV blocks found damaged on "
                                  "load (checksum or length mismatch) and recomputed instead (rank 0's).",
                                  labels=["model_name", "tier"])
        for tier, values in tiers.items():
            bad.add_metric([self.model_name, tier], float(values["corrupted"]))
        yield bad

    def _startup(self):
        """Seconds of each start-up phase of this process (shoal.engine.startup), and `total` to ready."""
        g = GaugeMetricFamily(PREFIX + "startup_seconds", "Seconds spent in each start-up phase (process, imports, "
                              "config, tokenizer, weights, kernel_build, kv_cache, warmup, graph_capture, other; "
                              "total: to ready).",
                              labels=["model_name", "phase"])
        for phase, seconds in startup.breakdown().items():
            g.add_metric([self.model_name, phase], seconds)
        return g

    def _cache_config(self, num_blocks: float):
        """vLLM's cache_config_info: the KV cache's shape as label values (value 1). Endpoint pickers' prefix-cache
        scorers (the Gateway API inference extension's EPP reads vllm:cache_config_info{block_size,num_gpu_blocks})
        size their model of each engine's cache from it; num_gpu_blocks is the pool's block count on any device."""
        cfg = getattr(self.engine, "config", None)
        if cfg is None:
            return
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"])
        info.add_metric([str(cfg.block_size), str(int(num_blocks)), str(cfg.kv_cache_dtype),
                         str(bool(cfg.enable_prefix_caching))], 1.0)
        yield info

    def _lora(self, s):
        """vLLM's lora_requests_info (adapters of running / waiting requests; the value is the snapshot's time) and
        the adapters resident (loaded) on this engine, which routers use for adapter affinity."""
        cfg = getattr(self.engine, "config", None)
        if not getattr(cfg, "enable_lora", False):
            return
        when = self.engine.snapshot.time
        info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(cfg.max_loras), ",".join(getattr(s, "lora_running", [])),
                         ",".join(getattr(s, "lora_waiting", []))], when)
        yield info
        resident = GaugeMetricFamily(PREFIX + "lora_resident_info", "LoRA adapters loaded on this engine.",
                                     labels=["max_cpu_lora", "resident_lora_adapters"])
        resident.add_metric([str(cfg.max_cpu_loras or cfg.max_loras), ",".join(getattr(s, "lora_resident", []))],
                            when)
        yield resident
        loads = CounterMetricFamily(PREFIX + "lora_loads", "LoRA adapter loads (at registration and again after "
                                    "an eviction).", labels=["model_name"])
        loads.add_metric([self.model_name], float(getattr(s, "lora_loads_total", 0) or 0))
        yield loads


class _VllmNamesCollector:
    """The `sources`' shoal: families again under vLLM's names, read at scrape time (nothing observed twice)."""

    def __init__(self, sources, model_name: str):
        self.sources = sources
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        lora_seen = False
        for source in self.sources:
            for family in source.collect():
                short = family.name.removeprefix(PREFIX)
                lora_seen |= short == "lora_requests_info"
                for alias in VLLM_ALIASES.get(short, ()):
                    copy = Metric(VLLM_PREFIX + alias, family.documentation, family.type, family.unit)
                    copy.samples = [s._replace(name=VLLM_PREFIX + alias + s.name[len(family.name):])
                                    for s in family.samples]
                    yield copy
        if not lora_seen:  # without --enable-lora: vLLM's LoRA info gauge with no adapters (value: reading time)
            lora = GaugeMetricFamily(VLLM_PREFIX + "lora_requests_info", "Running stats on LoRA requests (LoRA is "
                                     "not enabled).", labels=["max_lora", "running_lora_adapters",
                                                              "waiting_lora_adapters"])
            lora.add_metric(["0", "", ""], time.time())
            yield lora


class ServerMetrics(MetricsSink):
    """The per-app registry; also the AsyncEngine's MetricsSink."""

    def __init__(self, model_name: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, ln = self.registry, ["model_name"]
        # Which process this is: the HTTP server is always global rank 0 (pipeline stage 0, tensor rank 0);
        # headless workers publish shoal:worker_rank_info with their own ranks.
        Gauge(PREFIX + "parallel_info", "Parallel layout of this engine; this process is rank 0.",
              ln + ["rank", "tp_size", "pp_size"], registry=r).labels(
            model_name, "0", str(tensor_parallel_size), str(pipeline_parallel_size)).set(1)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       ln + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ln, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ln, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", ln, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", ln,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Number of prefill tokens processed.", ln,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram(PREFIX + "request_generation_tokens", "Number of generation tokens processed.", ln,
                                 buckets=TOKEN_BUCKETS, registry=r)
        self.structured_requests = Counter(
            PREFIX + "structured_output_requests", "Requests with grammar-constrained output, by constraint kind "
            "(json_schema, json_object, regex, choice, grammar, tool_call).", ln + ["kind"], registry=r)
        self.embedding_requests = Counter(
            PREFIX + "embedding_requests", "Finished /v1/embeddings inputs (one per string or token list).", ln,
            registry=r)
        self.embedding_tokens = Counter(
            PREFIX + "embedding_prompt_tokens", "Prompt tokens pooled into embeddings (also in prompt_tokens).", ln,
            registry=r)
        self.kv_transfer_blocks = Counter(
            PREFIX + "kv_transfer_blocks", "Prefill/decode disaggregation: KV blocks this engine pulled from a "
            "producer (pulled), asked for but the producer no longer held (missed: computed here), or served to a "
            "consumer (served).", ln + ["direction"], registry=r)
        self.kv_transfer_fallbacks = Counter(
            PREFIX + "kv_transfer_fallbacks", "Prompts a consumer prefilled itself instead of pulling their KV, by "
            "reason (unreachable, timeout, refused, incompatible, corrupted, malformed, images, lora).",
            ln + ["reason"], registry=r)
        self.kv_transfer_pull_seconds = Histogram(
            PREFIX + "kv_transfer_pull_seconds", "Time a consumer spent pulling one prompt's KV blocks.", ln,
            buckets=LATENCY_BUCKETS, registry=r)
        # Children bound once (label lookups are not free on the hot path).
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue = self.queue_time.labels(model_name)
        self._success = {reason: self.request_success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._prompt_len = self.prompt_len.labels(model_name)
        self._gen_len = self.gen_len.labels(model_name)
        self._embedding_requests = self.embedding_requests.labels(model_name)
        self._embedding_tokens = self.embedding_tokens.labels(model_name)

    def attach(self, engine: AsyncEngine) -> None:
        stats = _EngineStatsCollector(engine, self.model_name)
        self.registry.register(stats)
        self.registry.register(_VllmNamesCollector(
            [stats, self.request_success, self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_len,
             self.gen_len], self.model_name))

    # MetricsSink
    def on_first_token(self, ttft: float) -> None:
        self._ttft.observe(max(0.0, ttft))

    def on_inter_token(self, itl: float, num_tokens: int) -> None:
        # Several tokens in one step (rare) share the interval, as vLLM counts them.
        per = max(0.0, itl) / max(1, num_tokens)
        for _ in range(max(1, num_tokens)):
            self._itl.observe(per)

    def on_finished(self, output: RequestOutput, finished_time: float) -> None:
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        reason = reasons[0] if reasons else "stop" if output.embedding is not None else "abort"
        if output.embedding is not None:
            self._embedding_requests.inc()
            self._embedding_tokens.inc(len(output.prompt_token_ids))
        if reason not in self._success:
            self._success[reason] = self.request_success.labels(self.model_name, reason)
        self._success[reason].inc()
        m = output.metrics
        if m is None:
            return
        self._e2e.observe(max(0.0, finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if output.prompt_token_ids:
            self._prompt_len.observe(len(output.prompt_token_ids))
        if output.outputs:
            self._gen_len.observe(m.num_generation_tokens)

    def kv_transfer_pulled(self, got: int, missed: int, seconds: float) -> None:
        self.kv_transfer_blocks.labels(self.model_name, "pulled").inc(got)
        self.kv_transfer_blocks.labels(self.model_name, "missed").inc(missed)
        self.kv_transfer_pull_seconds.labels(self.model_name).observe(seconds)

    def kv_transfer_served(self, blocks: int) -> None:
        self.kv_transfer_blocks.labels(self.model_name, "served").inc(blocks)

    def kv_transfer_fallback(self, reason: str) -> None:
        self.kv_transfer_fallbacks.labels(self.model_name, reason).inc()

    def on_structured_request(self, kind: str) -> None:
        self.structured_requests.labels(self.model_name, kind).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

