"""An OTLP/HTTP trace collector for the tracing tests: the engine and the gateway export their spans to it as they
would to a real one (configured only by the standard OTEL_* variables)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prockit import free_port


class Collector:
    """An OTLP/HTTP trace receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest."""

    def __init__(self):
        self.spans: list = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                    for ss in rs.scope_spans:
                        spans.extend((service, s) for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()

    def env(self, service: str) -> dict[str, str]:
        """The variables that make a process export to this collector as `service`, in batches of 50 ms."""
        return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{self.port}/v1/traces",
                "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": service}

    def named(self, name: str, service: str | None = None, trace_id: str | None = None) -> list:
        """The spans called `name` (of `service`, in the trace `trace_id` in hex, where given)."""
        return [s for svc, s in self.spans if s.name == name and service in (None, svc)
                and trace_id in (None, s.trace_id.hex())]


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out
