"""OpenTelemetry traces of generation requests, exported over OTLP/HTTP. Off by default, and then free: nothing of
OpenTelemetry is imported and no span is made.

On when `--otlp-traces-endpoint URL` is given (vLLM's flag) or the standard variables name an exporter endpoint
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`); the other
`OTEL_*` variables (headers, timeout, `OTEL_SERVICE_NAME`, `OTEL_BSP_*` batching) are read by the SDK itself.
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. Needs the `tracing` extra.

A request's W3C `traceparent` (from the client or the gateway) is its parent. Spans are built when the request has
finished, from the timing record the engine kept anyway (RequestMetrics), so the engine loop does no extra work:
`shoal.engine.request` (arrival to finish; model, operation, token counts, tenant) with the children `queue`
(arrival to first scheduled), `prefill` (to the first token) and `decode` (to the finish), and a `first_token`
event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TENANT_HEADER = "X-Shoal-Tenant"


def tracing_configured(endpoint: str | None, environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return bool(endpoint or exporter == "otlp" or any(environ.get(v) for v in ENDPOINT_VARS))


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer:
    def __init__(self, service_name: str = "shoal-engine", endpoint: str | None = None, exporter: Any = None):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError(f"tracing needs OpenTelemetry: pip install 'shoal[tracing]' ({e})") from None
        name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        if exporter is None:
            # With a bare base URL (as vLLM's flag takes), the traces path is added here; the env variable the
            # SDK reads itself.
            if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
                endpoint = endpoint.rstrip("/") + "/v1/traces"
            exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("shoal.engine")
        self.propagator = TraceContextTextMapPropagator()
        self._server_kind, self._in_context = SpanKind.SERVER, set_span_in_context

    def record(self, headers: Mapping[str, str], operation: str, model: str, request_id: str, metrics: Any,
               prompt_tokens: int) -> None:
        """The spans of one finished (or aborted) engine request, as children of the caller's traceparent."""
        if metrics is None:  # never reached the engine
            return
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        parent = self.propagator.extract(carrier)
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                      "gen_ai.usage.input_tokens": prompt_tokens,
                      "gen_ai.usage.output_tokens": metrics.num_generation_tokens, "shoal.request_id": request_id}
        tenant = headers.get(TENANT_HEADER)
        if tenant:
            attributes["shoal.tenant"] = tenant
        end = metrics.finished_time or time.time()
        span = self.tracer.start_span("shoal.engine.request", context=parent, kind=self._server_kind,
                                      start_time=_ns(metrics.arrival_time), attributes=attributes)
        inside = self._in_context(span)
        phases = (("queue", metrics.arrival_time, metrics.first_scheduled_time),
                  ("prefill", metrics.first_scheduled_time, metrics.first_token_time),
                  ("decode", metrics.first_token_time, metrics.finished_time))
        for name, start, stop in phases:
            if start is not None and stop is not None:
                self.tracer.start_span(name, context=inside, start_time=_ns(start)).end(end_time=_ns(stop))
        if metrics.first_token_time is not None:
            span.add_event("first_token", timestamp=_ns(metrics.first_token_time))
        span.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Export what is still batched."""
        self.provider.shutdown()
