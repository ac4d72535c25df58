"""The real `shoal-engine serve` process on a tiny Llama, driven by the official openai client (sync + async,
streaming + not) for every route and parameter, every error case, client disconnects, and 64 concurrent streams.

One server for the whole module (starting one costs seconds).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from .conftest import metric

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(start_server, llama_model):
    return start_server(llama_model, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "320",
                        "--max-num-seqs", "64", "--block-size", "16")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(server):
    return AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = dict(temperature=0.0)


def wait_idle(server, timeout=10.0) -> dict:
    """Poll /metrics until nothing runs, waits or holds KV blocks; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = (metric(m, "shoal:num_requests_running") + metric(m, "shoal:num_requests_waiting")
                + metric(m, "shoal:kv_cache_usage_perc"))
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ basic routes
def test_health_models_version(server, client):
    for path in ("/startupz", "/readyz", "/livez", "/health"):
        assert server.get(path)[0] == 200, path
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = models.data[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "shoal" and card["max_model_len"] == MAX_MODEL_LEN
    status, body = server.get("/version")
    assert status == 200 and json.loads(body)["version"]


def test_completion_non_streaming(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and c.text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, **GREEDY)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stream_ends_with_done_and_usage(server):
    status, raw, headers = server.request(
        "POST", "/v1/completions",
        {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["X-Request-Id"].startswith("cmpl-")
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    for e in events[:-2]:
        assert json.loads(e[6:])["usage"] is None  # OpenAI sends usage: null on every other chunk


async def test_chat_stream_equals_non_stream_async(aclient):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hello! How are you?"}], max_tokens=20, **GREEDY)
    full = await aclient.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    stream = await aclient.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_sync_stream_and_max_completion_tokens(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=6, **GREEDY)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    s = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=6, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content


async def test_completion_async_streaming(aclient):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, **GREEDY)
    full = await aclient.completions.create(**kw)
    stream = await aclient.completions.create(stream=True, **kw)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == full.choices[0].text


# ------------------------------------------------------------------------------------------ parameters
def test_prompt_as_token_ids_and_tokenize_detokenize(server, client):
    prompt = "Kubernetes runs pods on nodes"
    status, tok, _ = server.post("/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200 and set(tok) >= {"tokens", "count", "max_model_len"}
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    status, detok, _ = server.post("/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": prompt}
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=tok["tokens"], max_tokens=10, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == tok["count"]
    # chat-shaped tokenize, and token strings
    status, chat_tok, _ = server.post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                    "return_token_strs": True})
    assert status == 200 and len(chat_tok["token_strs"]) == chat_tok["count"] > 0
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.usage.prompt_tokens == chat_tok["count"]


def test_batch_prompts_and_n(client):
    r = client.completions.create(model="tiny", prompt=["Hello world", "The quick brown fox"], n=2, max_tokens=6,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 24
    single = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, **GREEDY)
    greedy_batch = client.completions.create(model="tiny", prompt=["Hello world", "The quick brown fox"],
                                             max_tokens=6, **GREEDY)
    assert {c.index: c.text for c in greedy_batch.choices}[1] == single.choices[0].text
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=["Hello world", "The quick brown fox"],
                                           max_tokens=6, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in greedy_batch.choices}


def test_seed_reproducible_and_n_streaming(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    texts = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy: the chosen token is the top one
    e = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, echo=True, **GREEDY)
    assert e.choices[0].text == "Hello world" + r.choices[0].text
    s = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in s if c.choices) == e.choices[0].text
    s = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, logprobs=2, stream=True,
                                  **GREEDY)
    assert sum(len(c.choices[0].logprobs.tokens) for c in s if c.choices and c.choices[0].logprobs) == 5


def test_chat_logprobs(client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2 and isinstance(item.bytes, list)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
    s = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2,
                                       stream=True, **GREEDY)
    assert sum(len(c.choices[0].logprobs.content) for c in s if c.choices and c.choices[0].logprobs) == 4


def test_stop_strings(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, **GREEDY)
    text = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    # A stop string taken from the middle of the greedy output: the output stops right before it.
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    assert stop, text
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text) and r.choices[0].model_dump().get("stop_reason") == stop
    s = client.completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    inc = client.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert inc.choices[0].text == r.choices[0].text + stop


def test_vllm_sampling_extras(client):
    kw = dict(model="tiny", prompt="Hello world", max_tokens=10)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    top1 = client.completions.create(temperature=1.0, extra_body={"top_k": 1}, **kw).choices[0].text
    assert top1 == greedy
    r = client.completions.create(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=3,
                                  extra_body={"min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 10,
                                              "ignore_eos": True}, **kw)
    assert r.usage.completion_tokens == 10
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True, "min_tokens": 8,
                                                                     "stop_token_ids": [], "top_k": 5})
    assert chat.usage.completion_tokens == 8


def test_stop_token_ids(server):
    req = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
           "logprobs": 0}
    status, full, _ = server.post("/v1/completions", req)
    assert status == 200
    status, tok, _ = server.post("/tokenize", {"prompt": "Hello world" + full["choices"][0]["text"]})
    _, ptok, _ = server.post("/tokenize", {"prompt": "Hello world"})
    generated = tok["tokens"][ptok["count"]:]
    if len(generated) < 3:
        pytest.skip("re-tokenization merged the generated tokens")
    target = generated[2]
    status, r, _ = server.post("/v1/completions", dict(req, stop_token_ids=[target]))
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["stop_reason"] == target and r["usage"]["completion_tokens"] <= 3


# ------------------------------------------------------------------------------------------ errors
def _err(status_body):
    status, body, headers = status_body
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, body["error"], headers


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json_is_400(server, path):
    for raw in (b"{not json", b"[1, 2]", b'"text"', b""):
        status, body, headers = server.request("POST", path, raw)
        status, err, _ = _err((status, json.loads(body), headers))
        assert status == 400 and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "many"), ("temperature", "hot"), ("n", 1.5), ("stream", "yes"), ("prompt", 42),
    ("stop", 7), ("logprobs", "x"), ("top_k", [1]), ("seed", "abc"), ("stream_options", 3),
])
def test_wrong_types_are_400(server, field, value):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, field: value}
    status, err, _ = _err(server.post("/v1/completions", body))
    assert status == 400 and err["param"] and field in err["param"], err


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0),
    ("presence_penalty", 5.0), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", -1),
    ("stream_options", {"include_usage": True}),
    ("n", 0), ("n", 100000), ("logprobs", 50), ("min_tokens", -1),
])
def test_out_of_range_is_400(server, field, value):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, field: value}
    status, err, _ = _err(server.post("/v1/completions", body))
    assert status == 400, err
    assert err["param"] == field or field in err["message"], err


NASTY = [
    b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1e30}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop_token_ids": [-1]}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": [1, 2]}',
    b'{"model": "tiny", "prompt": [[1, "a"]], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": [-3], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs": -1}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": "yes"}}',
    b'{"model": 5, "prompt": "x"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": {"a": 1}}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": "two"}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": "high"}',
    b'[' * 100000,
]


def test_huge_seed_is_fine(server):
    status, body, _ = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                      "seed": 2**70, "temperature": 1.0})
    assert status in (200, 400), body
    assert server.get("/livez")[0] == 200


@pytest.mark.parametrize("i", range(len(NASTY)))
def test_nasty_input_is_400_and_server_survives(server, i):
    path = "/v1/chat/completions" if b'"messages"' in NASTY[i] else "/v1/completions"
    status, raw, headers = server.request("POST", path, NASTY[i])
    status, err, _ = _err((status, json.loads(raw), headers))
    assert status == 400, err
    assert server.get("/livez")[0] == 200
    ok, body, _ = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 1})
    assert ok == 200, body


def test_chat_errors_are_400(server):
    base = {"model": "tiny", "max_tokens": 2}
    cases = [
        dict(base, messages=[]),
        dict(base, messages="hi"),
        dict(base, messages=[{"content": "no role"}]),
        dict(base, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        dict(base, messages=[{"role": "user", "content": "hi"}], top_logprobs=3),  # without logprobs
        dict(base, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21),
        dict(base, messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]),
        dict(base, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=-2),
    ]
    for body in cases:
        status, err, _ = _err(server.post("/v1/chat/completions", body))
        assert status == 400, (body, err)


def test_too_long_prompt_is_400(server, client):
    long_prompt = "fish " * (MAX_MODEL_LEN * 2)
    status, err, _ = _err(server.post("/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 4}))
    assert status == 400 and "maximum context length" in err["message"]
    # prompt fits but prompt + max_tokens does not
    status, err, _ = _err(server.post("/v1/completions", {"model": "tiny", "prompt": "fish", "max_tokens": 10_000}))
    assert status == 400 and "maximum context length" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}])
    # empty prompt, token id out of range
    assert _err(server.post("/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 2}))[0] == 400
    assert _err(server.post("/v1/completions", {"model": "tiny", "prompt": [], "max_tokens": 2}))[0] == 400
    assert _err(server.post("/v1/completions", {"model": "tiny", "prompt": [10**9], "max_tokens": 2}))[0] == 400
    assert _err(server.post("/detokenize", {"model": "tiny", "tokens": [10**9]}))[0] == 400
    assert _err(server.post("/detokenize", {"model": "tiny", "tokens": "abc"}))[0] == 400


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)
    assert ei.value.status_code == 404
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "x"}),
                       ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})):
        status, err, _ = _err(server.post(path, body))
        assert status == 404 and err["code"] == "model_not_found" and "nope" in err["message"]
    status, raw, headers = server.request("GET", "/v1/nothing-here")
    assert status == 404 and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    status, raw, _ = server.request("GET", "/v1/completions")
    assert status == 405 and "error" in json.loads(raw)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=-3)
    assert ei.value.status_code == 400 and "temperature" in str(ei.value)


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_names_and_labels(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, **GREEDY)
    m = wait_idle(server)
    for name in ("shoal:num_requests_running", "shoal:num_requests_waiting", "shoal:kv_cache_usage_perc",
                 "shoal:num_preemptions_total", "shoal:prefix_cache_queries_total", "shoal:prefix_cache_hits_total",
                 "shoal:prompt_tokens_total", "shoal:generation_tokens_total",
                 "shoal:time_to_first_token_seconds_count", "shoal:inter_token_latency_seconds_count",
                 "shoal:e2e_request_latency_seconds_count", "shoal:request_queue_time_seconds_count"):
        assert any(k.startswith(name + '{') and 'model_name="tiny"' in k for k in m), name
    assert metric(m, "shoal:parallel_info", rank="0", tp_size="1", pp_size="1") == 1  # which rank this process is
    assert metric(m, "shoal:request_success_total", finished_reason="length") >= \
        metric(before, "shoal:request_success_total", finished_reason="length") + 1
    assert metric(m, "shoal:generation_tokens_total") >= metric(before, "shoal:generation_tokens_total") + 4
    assert metric(m, "shoal:time_to_first_token_seconds_count") >= \
        metric(before, "shoal:time_to_first_token_seconds_count") + 1
    assert metric(m, "shoal:inter_token_latency_seconds_count") >= \
        metric(before, "shoal:inter_token_latency_seconds_count") + 3
    # Prefix caching: the same long prompt twice hits the cache.
    prompt = "A paged cache keeps keys and values in fixed-size blocks. " * 4
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    h0 = metric(server.metrics(), "shoal:prefix_cache_hits_total")
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert metric(server.metrics(), "shoal:prefix_cache_hits_total") >= h0 + 16


def test_vllm_metric_names_mirror_the_shoal_ones(server, client):
    """Tools that expect vLLM's names (KEDA, inference-extension routers, dashboards) read the same values."""
    prompt = "Mirrored metrics share every value with the originals. " * 3
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    m = wait_idle(server)
    text = server.request("GET", "/metrics")[1].decode()
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    for shoal_name, vllm_names in (
            ("num_requests_running", ["num_requests_running"]), ("num_requests_waiting", ["num_requests_waiting"]),
            ("kv_cache_usage_perc", ["kv_cache_usage_perc", "gpu_cache_usage_perc"]),
            ("prefix_cache_queries_total", ["prefix_cache_queries_total"]),
            ("prefix_cache_hits_total", ["prefix_cache_hits_total"]),
            ("generation_tokens_total", ["generation_tokens_total"]),
            ("num_preemptions_total", ["num_preemptions_total"]),
            ("time_to_first_token_seconds_count", ["time_to_first_token_seconds_count"]),
            ("e2e_request_latency_seconds_sum", ["e2e_request_latency_seconds_sum"])):
        for vllm_name in vllm_names:
            assert metric(m, "vllm:" + vllm_name, model_name="tiny") == metric(m, "shoal:" + shoal_name), vllm_name
    assert metric(m, "vllm:prefix_cache_hits_total") > 0
    assert metric(m, "vllm:request_success_total", finished_reason="length") == \
        metric(m, "shoal:request_success_total", finished_reason="length") > 0
    assert metric(m, 'vllm:time_to_first_token_seconds_bucket', le="+Inf") == \
        metric(m, "shoal:time_to_first_token_seconds_count")
    assert metric(m, "vllm:lora_requests_info", max_lora="0", running_lora_adapters="") > 0  # no adapters
    # the KV cache's shape, as the inference extension's endpoint picker reads it (prefix-cache scorer)
    blocks = str(int(metric(m, "shoal:num_kv_blocks")))
    assert metric(m, "vllm:cache_config_info", block_size="16", num_gpu_blocks=blocks) == 1.0


# ------------------------------------------------------------------------------------------ disconnect
def test_client_disconnect_aborts_and_frees_kv(server):
    wait_idle(server)
    before = server.metrics()
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"data: ") < 4:  # a few tokens arrived
        got += sock.recv(65536)
    m = server.metrics()
    assert metric(m, "shoal:num_requests_running") == 1 and metric(m, "shoal:kv_cache_usage_perc") > 0
    sock.close()
    m = wait_idle(server, timeout=10)
    assert metric(m, "shoal:num_requests_running") == 0
    assert metric(m, "shoal:num_requests_waiting") == 0
    assert metric(m, "shoal:kv_cache_usage_perc") == 0
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")
    assert metric(m, "shoal:request_success_total", finished_reason="abort") == \
        metric(before, "shoal:request_success_total", finished_reason="abort") + 1
    assert metric(m, "shoal:generation_tokens_total") < metric(before, "shoal:generation_tokens_total") + 200


async def test_async_client_cancel_aborts(server, aclient):
    wait_idle(server)
    stream = await aclient.completions.create(model="tiny", prompt="Hello", max_tokens=200, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True})
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    await stream.close()
    m = await asyncio.to_thread(wait_idle, server)
    assert metric(m, "shoal:num_requests_running") == 0 and metric(m, "shoal:kv_cache_usage_perc") == 0


# ------------------------------------------------------------------------------------------ concurrency
async def test_64_concurrent_streams_match_sequential(server, aclient, client):
    prompts = [f"Request {i}: the shoal of fish number {i * 7 % 13} swam" for i in range(64)]
    max_tokens = 12
    sequential = [client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(p):
        stream = await aclient.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text, reasons = "", []
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        return text, reasons

    results = await asyncio.gather(*(one(p) for p in prompts))
    assert [r[1] for r in results] == [["length"]] * 64
    mismatches = [i for i, (r, s) in enumerate(zip(results, sequential)) if r[0] != s]
    assert not mismatches, f"{len(mismatches)} concurrent outputs differ from sequential ones: {mismatches[:5]}"
    m = await asyncio.to_thread(wait_idle, server)
    assert metric(m, "shoal:kv_cache_usage_perc") == 0


# ------------------------------------------------------------------------------------------ bench serve
@pytest.mark.parametrize("endpoint,arrival", [("completions", "poisson"), ("chat", "fixed")])
def test_bench_serve_json(server, capsys, endpoint, arrival):
    from shoal.engine.cli import main

    code = main(["bench", "serve", "--base-url", server.base, "--num-prompts", "6", "--input-len", "16",
                 "--output-len", "4", "--request-rate", "50", "--max-concurrency", "3", "--json",
                 "--endpoint", endpoint, "--arrival", arrival])
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["completed"] == 6 and res["failed"] == 0 and res["total_output_tokens"] == 24
    assert res["model"] == "tiny" and res["output_throughput"] > 0 and res["request_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        assert set(res[key]) >= {"p50", "p90", "p99"} and res[key]["p50"] is not None


def test_bench_serve_table(server, capsys):
    from shoal.engine.cli import main

    assert main(["bench", "serve", "--base-url", server.base + "/v1", "--model", "tiny", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "3"]) == 0
    out = capsys.readouterr().out
    for line in ("Request throughput (req/s)", "Output token throughput (tok/s)", "Time to First Token",
                 "Inter-token Latency", "p99 (ms)", "Failed requests"):
        assert line in out
