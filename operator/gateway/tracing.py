"""OpenTelemetry spans of the gateway's part of a request, exported over OTLP/HTTP; off unless the standard
variables name an endpoint (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_TRACES_EXPORTER=otlp`; `OTEL_SDK_DISABLED=true` / `OTEL_TRACES_EXPORTER=none` keep it off). Off, nothing of
OpenTelemetry is imported and the proxy's hooks are `None` checks.

A request gives `shoal.gateway.request` (a child of the client's W3C `traceparent`; model and tenant) with
`queue_wait` (admission: waiting for a slot and the pick of an engine) and one `engine_attempt` per engine tried
(its URL; a retry is a second attempt with the first one's failure as its `shoal.retry_reason`). The attempt's
context is sent to the engine as `traceparent`, so the engine's spans nest under it, and the tenant as
`X-Shoal-Tenant`.

A batch request (batch_runner.py) gives `shoal.gateway.batch_request`, a trace of its own (no client sends a
`traceparent`), with the batch id, the line's custom_id, the model and the tenant, and the same `engine_attempt`
child, so the engine's spans nest under it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

TENANT_HEADER = "X-Shoal-Tenant"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or any(environ.get(v) for v in ENDPOINT_VARS)


class GatewayTracer:
    def __init__(self, service_name: str = "shoal-gateway"):
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
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("shoal.gateway")
        self.propagator = TraceContextTextMapPropagator()
        self._server_kind, self._client_kind, self._in = SpanKind.SERVER, SpanKind.CLIENT, set_span_in_context

    def request(self, headers: Mapping[str, str], path: str, tenant: str) -> "RequestTrace":
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        span = self.tracer.start_span("shoal.gateway.request", context=self.propagator.extract(carrier),
                                      kind=self._server_kind, attributes={"http.route": path, "shoal.tenant": tenant})
        return RequestTrace(self, span, tenant)

    def batch_request(self, batch_id: str, custom_id: str, model: str, tenant: str) -> "RequestTrace":
        span = self.tracer.start_span("shoal.gateway.batch_request", kind=self._client_kind, attributes={
            "shoal.batch.id": batch_id, "shoal.batch.custom_id": custom_id, "gen_ai.request.model": model,
            "shoal.tenant": tenant})
        return RequestTrace(self, span, tenant)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request in the gateway."""

    def __init__(self, tracer: GatewayTracer, span: Any, tenant: str):
        self.t, self.span, self.tenant = tracer, span, tenant
        self.wait: Any = None
        self.attempt: Any = None

    def queue_started(self, model: str | None) -> None:
        if model:
            self.span.set_attribute("gen_ai.request.model", model)
        self.wait = self.t.tracer.start_span("queue_wait", context=self.t._in(self.span))

    def queue_ended(self, outcome: str) -> None:
        if self.wait is not None:
            self.wait.set_attribute("shoal.outcome", outcome)
            self.wait.end()
            self.wait = None

    def attempt_started(self, engine_url: str, headers: dict[str, str], retry_reason: str | None) -> None:
        """A span for sending to this engine; its context replaces the traceparent the engine gets."""
        self.attempt_ended()
        attributes = {"server.address": engine_url}
        if retry_reason:
            attributes["shoal.retry_reason"] = retry_reason
        self.attempt = self.t.tracer.start_span("engine_attempt", context=self.t._in(self.span),
                                                kind=self.t._client_kind, attributes=attributes)
        for k in [k for k in headers if k.lower() in ("traceparent", "tracestate")]:
            del headers[k]
        self.t.propagator.inject(headers, context=self.t._in(self.attempt))
        headers[TENANT_HEADER] = self.tenant  # the engine's spans name it too (a client's own value is replaced)

    def attempt_ended(self, status: int | str | None = None) -> None:
        if self.attempt is not None:
            if status is not None:
                self.attempt.set_attribute("shoal.result", str(status))
            self.attempt.end()
            self.attempt = None

    def end(self, status: int | None) -> None:
        """None: no answer (a batch request the engine refused or never got; tried again)."""
        self.queue_ended("abandoned")
        self.attempt_ended()
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        self.span.end()
