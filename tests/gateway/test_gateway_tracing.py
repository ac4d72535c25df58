"""One trace from the client through the gateway to the engine: a real `shoal-gateway` and a real engine, both
exporting over OTLP/HTTP (configured only by the standard OTEL_* variables) to a collector this test runs."""

from __future__ import annotations

from otlpkit import Collector, attributes

from .gwkit import Proc, engine_cmd, gateway_cmd, http, wait_for

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_spans_nest_gateway_then_engine_in_one_trace(llama_model):
    collector = Collector()
    engine = Proc(engine_cmd(llama_model), env=collector.env("engine"))
    gateway = None
    try:
        engine.wait_ready(300)
        gateway = Proc(gateway_cmd(engine.url), env=collector.env("gateway")).wait_ready(120)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, raw, _ = http("POST", gateway.url + "/v1/chat/completions", body,
                              {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, timeout=300)
        assert status == 200, raw
        wait_for(lambda: collector.named("shoal.engine.request") and collector.named("shoal.gateway.request"), 60,
                 "the gateway's and the engine's request spans at the collector")
        (gw,) = collector.named("shoal.gateway.request", "gateway")
        (wait,) = collector.named("queue_wait", "gateway")
        (attempt,) = collector.named("engine_attempt", "gateway")
        (eng,) = collector.named("shoal.engine.request", "engine")
        assert {s.trace_id.hex() for s in (gw, wait, attempt, eng)} == {TRACE_ID}
        assert gw.parent_span_id.hex() == CLIENT_SPAN
        assert wait.parent_span_id == attempt.parent_span_id == gw.span_id
        assert eng.parent_span_id == attempt.span_id  # the engine's work nests under the gateway's attempt
        g, e = attributes(gw), attributes(eng)
        assert g["gen_ai.request.model"] == e["gen_ai.request.model"] == "tiny"
        assert g["http.response.status_code"] == 200 and e["gen_ai.usage.output_tokens"] == 4
        assert e["shoal.tenant"] == g["shoal.tenant"] and attributes(attempt)["server.address"] == engine.url
        assert gw.start_time_unix_nano <= wait.end_time_unix_nano <= attempt.start_time_unix_nano
        assert attempt.start_time_unix_nano <= eng.start_time_unix_nano <= eng.end_time_unix_nano
        assert eng.end_time_unix_nano <= gw.end_time_unix_nano
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()
        collector.close()
