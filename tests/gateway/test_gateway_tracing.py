"""One trace from the client through the gateway to the engine: a real `shoal-gateway` and a real engine, both
exporting over OTLP/HTTP (configured only by the standard OTEL_* variables) to a collector this test runs; a retry
after a busy engine, and the shared gateway naming the tenant a key belongs to."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from fleetkit import StandInChatEngines
from otlpkit import attributes

from shoal.operator.gateway.proxy import GatewayConfig

from .gwkit import Proc, engine_cmd, gateway_cmd, http, wait_for
from .test_admission import Engine, endpoint_slice, isvc, shared, until
from .test_tenancy import auth, keys

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def engine(llama_model, collector):
    e = Proc(engine_cmd(llama_model), env=collector.env("engine"))
    try:
        yield e.wait_ready(300)
    finally:
        e.stop()


@pytest.fixture
def traced_gateway(collector):
    """start(*engine_urls, routing=...) -> a running shoal-gateway exporting to the collector, stopped after."""
    procs: list[Proc] = []

    def start(*endpoints: str, routing: str = "prefix-load") -> Proc:
        procs.append(Proc(gateway_cmd(*endpoints, routing=routing), env=collector.env("gateway")))
        return procs[-1].wait_ready(120)

    yield start
    for p in procs:
        p.stop()


def chat(gateway: Proc, trace_id: str, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    status, raw, _ = http("POST", gateway.url + "/v1/chat/completions", body,
                          {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}, timeout=300)
    assert status == 200, raw
    return raw


def test_spans_nest_gateway_then_engine_in_one_trace(engine, collector, traced_gateway):
    gateway = traced_gateway(engine.url)
    chat(gateway, TRACE_ID)
    wait_for(lambda: collector.named("shoal.engine.request", trace_id=TRACE_ID)
             and collector.named("shoal.gateway.request", trace_id=TRACE_ID), 60,
             "the gateway's and the engine's request spans at the collector")
    (gw,) = collector.named("shoal.gateway.request", "gateway", TRACE_ID)
    (wait,) = collector.named("queue_wait", "gateway", TRACE_ID)
    (attempt,) = collector.named("engine_attempt", "gateway", TRACE_ID)
    (eng,) = collector.named("shoal.engine.request", "engine", TRACE_ID)
    assert gw.parent_span_id.hex() == CLIENT_SPAN
    assert wait.parent_span_id == attempt.parent_span_id == gw.span_id
    assert eng.parent_span_id == attempt.span_id  # the engine's work nests under the gateway's attempt
    g, e, a = attributes(gw), attributes(eng), attributes(attempt)
    assert g["gen_ai.request.model"] == e["gen_ai.request.model"] == "tiny"
    assert g["http.response.status_code"] == 200 and e["gen_ai.usage.output_tokens"] == 4
    # the tokens as the engine's answer reports them (its JSON body's usage)
    assert g["gen_ai.usage.output_tokens"] == 4 and g["gen_ai.usage.input_tokens"] == e["gen_ai.usage.input_tokens"]
    assert e["shoal.tenant"] == g["shoal.tenant"] and a["server.address"] == engine.url
    # the pick: which policy chose this engine, and why (a fresh prompt: no engine holds it)
    assert a["shoal.attempt"] == 1 and a["shoal.routing.policy"] == "prefix-load"
    assert a["shoal.routing.decision"] == "cold" and "shoal.retry_reason" not in a
    assert gw.start_time_unix_nano <= wait.end_time_unix_nano <= attempt.start_time_unix_nano
    assert attempt.start_time_unix_nano <= eng.start_time_unix_nano <= eng.end_time_unix_nano
    assert eng.end_time_unix_nano <= gw.end_time_unix_nano


def test_a_retry_after_a_busy_engine_is_a_second_attempt_in_the_same_trace(engine, collector, traced_gateway):
    busy = StandInChatEngines(["busy"])
    busy.failing.add("busy")
    busy.failing_status = 503  # a full queue: the gateway tries the other engine
    try:
        # round-robin: of two requests, one at least goes to the busy engine first
        gateway = traced_gateway(f"http://127.0.0.1:{busy.ports['busy']}", engine.url, routing="round-robin")
        traces = [f"{TRACE_ID[:-1]}{i}" for i in (1, 2)]
        for trace_id in traces:
            raw = chat(gateway, trace_id, stream=True, stream_options={"include_usage": True})
            assert b"[DONE]" in raw
        assert busy.served("busy") >= 1
        wait_for(lambda: len(collector.named("shoal.engine.request", trace_id=traces[0])) +
                 len(collector.named("shoal.engine.request", trace_id=traces[1])) == 2
                 and all(collector.named("shoal.gateway.request", trace_id=t) for t in traces), 60,
                 "both requests' spans at the collector")
        retried = [t for t in traces if len(collector.named("engine_attempt", "gateway", t)) == 2]
        assert len(retried) == busy.served("busy")  # each request the busy engine refused, and only those
        retried = retried[0]
        (gw,) = collector.named("shoal.gateway.request", "gateway", retried)
        first, second = sorted(collector.named("engine_attempt", "gateway", retried),
                               key=lambda s: s.start_time_unix_nano)
        (eng,) = collector.named("shoal.engine.request", "engine", retried)
        assert first.parent_span_id == second.parent_span_id == gw.span_id
        f, s = attributes(first), attributes(second)
        # the first attempt says how it failed, the second why it is a retry
        assert (f["shoal.attempt"], f["server.address"], f["shoal.result"]) == \
            (1, f"http://127.0.0.1:{busy.ports['busy']}", "status_503") and "shoal.retry_reason" not in f
        assert (s["shoal.attempt"], s["server.address"], s["shoal.retry_reason"], s["shoal.result"]) == \
            (2, engine.url, "status_503", "200")
        assert s["shoal.routing.policy"] == "round-robin" and s["shoal.routing.decision"] == "round-robin"
        assert first.end_time_unix_nano <= second.start_time_unix_nano
        assert eng.parent_span_id == second.span_id  # only the attempt that reached the engine has its spans
        # the tokens from the stream's final usage chunk
        g = attributes(gw)
        assert g["gen_ai.usage.output_tokens"] == 4 and g["gen_ai.usage.input_tokens"] > 0
        assert g["http.response.status_code"] == 200
    finally:
        busy.close()


class UsageEngine(Engine):
    """A stand-in engine whose completions report their usage, as OpenAI's do."""

    async def complete(self, request):
        body = await request.json()
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})


async def test_the_shared_gateway_names_the_tenant_of_the_key_and_the_tokens(collector, tmp_path, monkeypatch):
    for k, v in collector.env("shared-gateway").items():
        monkeypatch.setenv(k, v)
    async with UsageEngine("chat", served="chat", hold=False) as chat_engine:
        engine_url = chat_engine.url
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), models_interval=0.1),
                                  [isvc("chat", "chat", namespace="team-a")], {})
        gw.pools.slices_reset([endpoint_slice("chat-engines", chat_engine.url, namespace="team-a")])
        await until(lambda: any(p.backends.eligible() for p in gw.pools.all()))
        try:
            r = await client.post("/v1/completions", json={"model": "chat", "prompt": "x"},
                                  headers={**auth("sk-a"), "traceparent": f"00-{TRACE_ID[:-1]}a-{CLIENT_SPAN}-01"})
            assert r.status == 200, await r.text()
            assert json.loads(await r.text())["usage"]["completion_tokens"] == 3
        finally:
            await client.close()
            await gw.stop()  # flushes its spans
    (span,) = collector.named("shoal.gateway.request", "shared-gateway", f"{TRACE_ID[:-1]}a")
    a = attributes(span)
    assert a["shoal.tenant"] == "team-a" and a["gen_ai.request.model"] == "chat"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (7, 3)
    (attempt,) = collector.named("engine_attempt", "shared-gateway", f"{TRACE_ID[:-1]}a")
    assert attributes(attempt)["server.address"] == engine_url


class RecordingSpan:
    def __init__(self):
        self.attributes: dict = {}

    def set_attribute(self, key, value):
        self.attributes[key] = value


@pytest.mark.parametrize("events, expected", [
    # Anthropic Messages: the input in message_start, the output in the last message_delta
    ([{"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}},
      {"type": "content_block_delta", "delta": {"text": "usage"}},
      {"type": "message_delta", "usage": {"output_tokens": 5}}], (9, 5)),
    # Responses: response.created carries no usage yet, response.completed does
    ([{"type": "response.created", "response": {"usage": None}},
      {"type": "response.completed", "response": {"usage": {"input_tokens": 4, "output_tokens": 2}}}], (4, 2)),
    # chat without include_usage: no usage, so no token attributes
    ([{"choices": [{"delta": {"content": "hi"}}], "usage": None}], None),
])
def test_the_usage_of_a_stream_is_read_across_chunk_boundaries(events, expected):
    from shoal.operator.gateway.tracing import UsageReader

    span = RecordingSpan()
    reader = UsageReader(span, stream=True)
    raw = b"".join(b"event: x\ndata: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for i in range(0, len(raw), 7):  # chunks that cut lines anywhere
        reader.feed(raw[i:i + 7])
    reader.close()
    got = (span.attributes.get("gen_ai.usage.input_tokens"), span.attributes.get("gen_ai.usage.output_tokens"))
    assert got == (expected or (None, None))
