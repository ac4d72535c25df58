"""shoal:gateway_* metrics. Per-engine and per-service gauges are read from the pools at scrape time, so an engine
(or an InferenceService) that left leaves no stale series behind. Every gateway gets its own registry (several
can share a process)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from shoal.operator import contract

if TYPE_CHECKING:
    from shoal.operator.gateway.proxy import Gateway

P = contract.GATEWAY_METRIC_PREFIX
PICK_BUCKETS = [0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1]
# time to the first byte of an answer (TTFT for streams, the whole answer otherwise): the canary's latency SLO
FIRST_BYTE_BUCKETS = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0]
WAIT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0]


# The engines' load as this gateway last polled it, for the operator's autoscaler (loadSource gateways or auto:
# engines it cannot scrape itself, e.g. behind Istio STRICT mTLS, which the gateway reaches through the mesh). Only
# fresh data is exported: a missing series means "not known", never zero. With inflight_requests (this gateway's
# own count per engine) and held_requests it is all the autoscaler needs; labelled by the engine's base URL.
ENGINE_GAUGES = (("backend_running_requests", "running", "Requests running on the engine (its own gauge)."),
                 ("backend_waiting_requests", "waiting", "Requests waiting in the engine's queue (its own gauge)."),
                 ("backend_kv_cache_usage", "kv_usage", "The engine's KV-cache usage (1.0 = full)."),
                 ("backend_waiting_prefill_tokens", "waiting_prefill_tokens",
                  "Prompt tokens waiting for prefill on the engine."))


class _PoolCollector:
    def __init__(self, gateway: "Gateway"):
        self.gateway = gateway

    def describe(self):
        return []

    def collect(self):
        now = time.monotonic()
        healthy = GaugeMetricFamily(P + "backend_healthy", "1 when the engine may take new requests.",
                                    labels=["backend"])
        circuit = GaugeMetricFamily(P + "backend_circuit_open", "1 while the engine's circuit breaker is open.",
                                    labels=["backend"])
        inflight = GaugeMetricFamily(contract.GATEWAY_INFLIGHT_REQUESTS, "Requests this gateway has in flight to the engine.",
                                     labels=["backend"])
        load = GaugeMetricFamily(P + "backend_load", "The engine's load as the router scores it (requests).",
                                 labels=["backend"])
        queued = GaugeMetricFamily(P + "queued_requests", "Requests waiting for an engine slot (or for an engine "
                                   "to exist), by priority.", labels=["priority"])
        service = GaugeMetricFamily(P + "service_requests", "Requests of this gateway per InferenceService (shared "
                                    "gateway): held (no engine yet), queued (waiting for a slot, held included) "
                                    "and inflight (at an engine).", labels=["namespace", "inferenceservice", "state"])
        adapters = GaugeMetricFamily(P + "backend_adapters", "LoRA adapters the engine lists in its /v1/models "
                                     "(only while that list is fresh).", labels=["backend"])
        engine_load = [(GaugeMetricFamily(P + name, doc, labels=["backend"]), field)
                       for name, field, doc in ENGINE_GAUGES]
        kv_blocks = GaugeMetricFamily(P + "kv_blocks", "KV blocks the engine reports holding in its KV events "
                                      "(precise-prefix routing; 0 after its view was reset).", labels=["backend"])
        kv_media = GaugeMetricFamily(P + "kv_medium_blocks", "KV blocks the engine reports holding per medium: its "
                                     "KV cache (GPU; CPU on a Shoal CPU engine) or an offload tier (CPU, CPU_OFFLOAD, "
                                     "DISK); a block in two media counts in each (precise-prefix routing).",
                                     labels=["backend", "medium"])
        ready = 0
        adapter_waits = 0
        by_priority: dict[int, int] = {}
        for pool in self.gateway.pools.all():
            eligible = set(pool.backends.eligible(now))
            ready += len(eligible)
            for b in pool.backends.all():
                healthy.add_metric([b.url], 1.0 if b in eligible else 0.0)
                circuit.add_metric([b.url], 1.0 if b.circuit_open(now) else 0.0)
                inflight.add_metric([b.url], float(b.inflight))
                load.add_metric([b.url], b.load(now))
                if b.adapters_fresh(now):
                    adapters.add_metric([b.url], float(len(b.adapters)))
                if b.fresh(now):
                    for family, field in engine_load:
                        family.add_metric([b.url], float(getattr(b, field)))
            kv_index = getattr(pool.router, "kv_index", None)
            if kv_index is not None:
                for b in pool.backends.all():
                    view = kv_index.views.get(b.url)
                    kv_blocks.add_metric([b.url], float(len(view.blocks)) if view is not None else 0.0)
                    for medium, n in sorted(view.media_blocks().items() if view is not None else ()):
                        kv_media.add_metric([b.url, medium], float(n))
            adapter_waits += pool.adapter_waits
            for priority, n in pool.queue.by_priority().items():
                by_priority[priority] = by_priority.get(priority, 0) + n
            if pool.name:
                labels = [pool.namespace, pool.name]
                service.add_metric(labels + ["held"], float(pool.held))
                service.add_metric(labels + ["queued"], float(len(pool.queue)))
                service.add_metric(labels + ["inflight"], float(sum(b.inflight for b in pool.backends.all())))
        for priority, n in sorted(by_priority.items()):
            queued.add_metric([str(priority)], float(n))
        yield healthy
        yield circuit
        yield inflight
        yield load
        for family, _ in engine_load:
            yield family
        yield adapters
        yield kv_blocks
        yield kv_media
        yield queued
        yield GaugeMetricFamily(P + "adapter_wait_requests", "Requests waiting for an engine to list their LoRA "
                                "adapter (loading, or reloading after a restart).", value=adapter_waits)
        yield GaugeMetricFamily(P + "ready_backends", "Engines that may take new requests.", value=ready)
        yield GaugeMetricFamily(P + "declared_adapters", "LoRA adapters the InferenceService(s) declare in "
                                "spec.adapters, as the gateway last read them (a per-service gateway reads its "
                                "own with --inference-service).",
                                value=sum(len(pool.adapters) for pool in self.gateway.pools.all()))
        batches = self.gateway.batches
        if batches is not None:
            pending = GaugeMetricFamily(contract.GATEWAY_BATCH_PENDING_REQUESTS, "Batch requests not finished yet "
                                        "(waiting for capacity, or for an engine to exist, or at an engine), by "
                                        "model; the operator's autoscaler keeps the service awake while any remain.",
                                        labels=["model"])
            for model, n in sorted(batches.runner.pending().items()):
                pending.add_metric([model], float(n))
            yield pending
        if not self.gateway.pools.shared:  # a per-service gateway: its one pool's canary split (spec.canary)
            for pool in self.gateway.pools.all():
                yield GaugeMetricFamily(P + "canary_percent", "Share of conversations sent to the canary revision "
                                        "(the engines Service's label).", value=pool.backends.canary_percent)
                yield GaugeMetricFamily(P + "canary_backends", "Engines of the canary revision.",
                                        value=sum(1 for b in pool.backends.all() if b.revision == "canary"))
        if self.gateway.pools.shared:
            yield service
            yield GaugeMetricFamily(P + "models", "Model names the shared gateway routes (base models and "
                                    "adapters), each namespace's counted apart.",
                                    value=sum(len(by_ns) for by_ns in self.gateway.pools.index().values()))


class GatewayMetrics:
    def __init__(self, gateway: "Gateway"):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter(P + "requests", "Requests answered, by engine (\"none\" when no engine answered) "
                                "and HTTP status.", ["backend", "code"], registry=r)
        self.pick_latency = Histogram(P + "pick_latency_seconds", "Time the router takes to choose an engine.",
                                      buckets=PICK_BUCKETS, registry=r)
        self.retries = Counter(P + "retries", "Requests retried on another engine before any byte reached the "
                               "client, by reason.", ["reason"], registry=r)
        self.remote_prefills = Counter(
            P + "remote_prefills", "Prefill/decode disaggregation (--prefill-endpoint/--prefill-service): prefills "
            "sent to a prefill engine, by outcome: ok (the decode engine pulls the KV), unavailable (no prefill "
            "engine usable), refused, timeout, failed, status_<code>, no_params (it answered without "
            "kv_transfer_params). Every outcome but ok leaves the prefill to the decode engine.", ["outcome"],
            registry=r)
        self.remote_prefill_seconds = Histogram(P + "remote_prefill_seconds", "Time a successful remote prefill "
                                                "took, before the request went to its decode engine.",
                                                buckets=FIRST_BYTE_BUCKETS, registry=r)
        self.decisions = Counter(P + "routing_decisions", "Routing decisions: affinity | cold | spill | "
                                 "least-load | round-robin.", ["decision"], registry=r)
        self.affinity_hits = Counter(P + "prefix_affinity_hits", "Requests sent to an engine that served a "
                                     "matching prompt prefix before.", registry=r)
        self.precise_hits = Counter(P + "precise_prefix_hits", "Requests sent to an engine that reported holding "
                                    "leading KV blocks of the prompt (precise-prefix).", registry=r)
        self.precise_blocks = Counter(P + "precise_prefix_matched_blocks", "Leading KV blocks of the prompts that "
                                      "the chosen engine reported holding (precise-prefix).", registry=r)
        self.precise_fallbacks = Counter(
            P + "precise_prefix_fallbacks", "precise-prefix requests routed by the approximate prefix index "
            "instead, by reason: cache_salt (a tenant's salted prompt), no_events (no engine of the pool reports a "
            "block), tokenizer_unavailable / tokenize_failed (the pool's engines could not tokenize: backing off), "
            "tokenize_refused (the engine refused this prompt).", ["reason"], registry=r)
        self.matched_chars = Counter(P + "prefix_matched_chars", "Prompt characters matched by prefix affinity.",
                                     registry=r)
        self.rejected = Counter(P + "rejected", "Requests refused by the gateway itself, by reason.", ["reason"],
                                registry=r)
        self.pending = Gauge(P + "pending_requests", "Requests inside the gateway (proxied or held).", registry=r)
        self.held = Gauge(contract.GATEWAY_HELD_REQUESTS, "Requests waiting for an engine to become ready.", registry=r)
        self.queue_wait = Histogram(P + "queue_wait_seconds", "Time from a request's arrival to its dispatch to "
                                    "an engine, by priority (0 for requests that found a free slot).", ["priority"],
                                    buckets=WAIT_BUCKETS, registry=r)
        # OpenAI Batches (batch_runner.py): their requests, apart from the proxied ones above
        self.batch_requests = Counter(P + "batch_requests", "Batch requests by outcome: completed (2xx, in the "
                                      "output file), failed (another answer, in the error file), requeued (refused "
                                      "by the engine before running: tried again).", ["outcome"], registry=r)
        self.batch_running = Gauge(P + "batch_requests_running", "Batch requests this gateway has at engines.",
                                   registry=r)
        # per revision (spec.canary: stable | canary), read by the operator's canary judge (canary_judge.py)
        self.revision_requests = Counter(contract.GATEWAY_REVISION_REQUESTS,
                                         "Requests answered per revision, by outcome: ok, error (5xx, or the engine "
                                         "failed or timed out) or cancelled (the client left).",
                                         ["revision", "outcome"], registry=r)
        self.revision_first_byte = Histogram(contract.GATEWAY_REVISION_FIRST_BYTE, "Time from dispatch to the "
                                             "answer's first byte per revision (time to first token for streams).",
                                             ["revision"], buckets=FIRST_BYTE_BUCKETS, registry=r)
        r.register(_PoolCollector(gateway))

    def revision_outcome(self, revision: str, code: str, first_byte: float | None = None) -> None:
        """One answered request of `revision`; `code` as in `requests` (an HTTP status, broken, client_closed)."""
        outcome = "error" if code.startswith("5") or code == "broken" else \
            "cancelled" if code == "client_closed" else "ok"
        self.revision_requests.labels(revision, outcome).inc()
        if first_byte is not None and outcome != "cancelled":
            self.revision_first_byte.labels(revision).observe(first_byte)
