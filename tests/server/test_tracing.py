"""Request traces from a real `serve` process, exported over OTLP/HTTP (configured only by the standard OTEL_*
variables) to a collector this test runs: the spans carry the client's trace id, nest under its traceparent, and
hold the model, token counts and tenant."""

from __future__ import annotations

import pytest
from openai import OpenAI
from otlpkit import attributes
from prockit import wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_spans_nest_under_the_callers_traceparent(start_server, llama_model, collector):
    env = collector.env("engine-under-test")
    server = start_server(llama_model, "--max-model-len", "256", "--num-kv-blocks", "64", env=env,
                          wait=False).wait_ready(timeout=300)
    client = OpenAI(base_url=server.base + "/v1", api_key="k", max_retries=0, timeout=300)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Shoal-Tenant": "team-a"}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       extra_headers=headers)
    client.responses.create(model="tiny", input="Hi", max_output_tokens=3, extra_headers=headers)
    client.completions.create(model="tiny", prompt="untraced", max_tokens=2)  # no traceparent: a trace of its own

    def spans_named(name):
        return [s for _, s in collector.spans if s.name == name]

    wait_for(lambda: len(spans_named("shoal.engine.request")) == 3 and len(spans_named("decode")) == 3, 60,
             "three request spans and their phases at the collector")
    assert {svc for svc, _ in collector.spans} == {"engine-under-test"}
    by_op = {attributes(s)["gen_ai.operation.name"]: s for s in spans_named("shoal.engine.request")}
    chat, resp, untraced = by_op["chatcmpl"], by_op["responses"], by_op["cmpl"]
    for span in (chat, resp):
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert untraced.trace_id.hex() != TRACE_ID and not untraced.parent_span_id
    a = attributes(chat)
    assert a["gen_ai.request.model"] == "tiny" and a["shoal.tenant"] == "team-a"
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens and a["gen_ai.usage.output_tokens"] == 5
    assert a["shoal.request_id"] == r.id
    children = [s for _, s in collector.spans if s.parent_span_id == chat.span_id]
    assert sorted(s.name for s in children) == ["decode", "prefill", "queue"]
    by_name = {s.name: s for s in children}
    assert (chat.start_time_unix_nano == by_name["queue"].start_time_unix_nano
            <= by_name["queue"].end_time_unix_nano == by_name["prefill"].start_time_unix_nano
            <= by_name["prefill"].end_time_unix_nano == by_name["decode"].start_time_unix_nano
            <= by_name["decode"].end_time_unix_nano <= chat.end_time_unix_nano)
    assert [e.name for e in chat.events] == ["first_token"]
    assert chat.events[0].time_unix_nano == by_name["prefill"].end_time_unix_nano
