"""OpenTelemetry spans of the gateway's part of a request, exported over OTLP/HTTP; off unless the standard
variables name an endpoint (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_TRACES_EXPORTER=otlp`; `OTEL_SDK_DISABLED=true` / `OTEL_TRACES_EXPORTER=none` keep it off). Off, nothing of
OpenTelemetry is imported and the proxy's hooks are `None` checks.

A request gives `shoal.gateway.request` (a child of the client's W3C `traceparent`; model, tenant, and the prompt
and completion tokens when the engine's answer reports its usage) with `queue_wait` (admission: waiting for a slot
and the pick of an engine) and one `engine_attempt` per engine tried: its URL, its number, the routing policy and
why it picked that engine (the pick takes microseconds, so it is named on the attempt it led to rather than given a
span of its own), and on a retry the previous attempt's failure as `shoal.retry_reason`. The attempt's context is
sent to the engine as `traceparent`, so the engine's spans nest under it, and the tenant as `X-Shoal-Tenant`.

A batch request (batch_runner.py) gives `shoal.gateway.batch_request`, a trace of its own (no client sends a
`traceparent`), with the batch id, the line's custom_id, the model and the tenant, and the same `engine_attempt`
child, so the engine's spans nest under it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

TENANT_HEADER = "X-Shoal-Tenant"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
USAGE_BODY_LIMIT = 1 << 20  # a longer JSON answer (a large embeddings batch) is not kept to read its usage
# the APIs' names for the usage counts: OpenAI chat/completions, then Responses and Anthropic Messages
INPUT_KEYS, OUTPUT_KEYS = ("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens")


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

    def attempt_started(self, engine_url: str, headers: dict[str, str], retry_reason: str | None, number: int = 1,
                        policy: str | None = None, pick: Any = None) -> None:
        """A span for sending to this engine (`pick`: the router's routing.Pick of it, under `policy`); its context
        replaces the traceparent the engine gets."""
        self.attempt_ended()
        attributes: dict[str, Any] = {"server.address": engine_url, "shoal.attempt": number}
        if policy:
            attributes["shoal.routing.policy"] = policy
        if pick is not None:
            attributes["shoal.routing.decision"] = pick.decision
            attributes["shoal.routing.matched_blocks"] = pick.matched_blocks
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

    def usage_reader(self, content_type: str) -> "UsageReader":
        return UsageReader(self.span, "event-stream" in content_type)

    def end(self, status: int | None) -> None:
        """None: no answer (a batch request the engine refused or never got; tried again)."""
        self.queue_ended("abandoned")
        self.attempt_ended(status)
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        self.span.end()


class UsageReader:
    """Reads the token usage out of the answer the gateway relays (fed its chunks as they pass): the JSON body's
    `usage`, or in a stream the last usage an event carries (OpenAI's final chunk with `include_usage`, Responses'
    `response.completed`, Anthropic's `message_start` then `message_delta`). It names them on the request span as
    `gen_ai.usage.input_tokens` / `gen_ai.usage.output_tokens`; an answer that reports none gets neither."""

    def __init__(self, span: Any, stream: bool):
        self.span, self.stream = span, stream
        self.kept = bytearray()  # the JSON body, or the stream's unfinished line
        self.overflow = False  # a body (or one line) longer than USAGE_BODY_LIMIT: the rest is not read
        self.usage: dict[str, int] = {}

    def feed(self, chunk: bytes) -> None:
        if self.overflow:
            return
        self.kept += chunk
        if len(self.kept) > USAGE_BODY_LIMIT and (not self.stream or b"\n" not in chunk):
            self.kept, self.overflow = bytearray(), True
            return
        if self.stream and b"\n" in chunk:
            *lines, rest = bytes(self.kept).split(b"\n")
            self.kept = bytearray(rest)
            for line in lines:
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._read(line[5:])

    def _read(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        for holder in (obj, obj.get("response"), obj.get("message")):
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if isinstance(usage, dict):
                for name, keys in (("gen_ai.usage.input_tokens", INPUT_KEYS),
                                   ("gen_ai.usage.output_tokens", OUTPUT_KEYS)):
                    value = next((usage[k] for k in keys if isinstance(usage.get(k), int)), None)
                    if value is not None:
                        self.usage[name] = value

    def close(self) -> None:
        if not self.stream and not self.overflow and self.kept:
            self._read(bytes(self.kept))
        for name, value in self.usage.items():
            self.span.set_attribute(name, value)
