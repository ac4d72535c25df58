"""In-process pieces of the HTTP server: protocol models, metrics, and the aiohttp app over a real AsyncEngine
(health while loading, a failed load, engine death, the --chat-template flag)."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
from pydantic import ValidationError

from shoal.engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_to_api_error,
)


# ------------------------------------------------------------------------------------------ protocol
def test_completion_prompt_shapes():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[]).prompts()


def test_sampling_kwargs_use_vllm_names():
    r = CompletionRequest(prompt="x", temperature=0.5, top_k=4, min_p=0.1, repetition_penalty=1.1, ignore_eos=True,
                          min_tokens=2, stop="END", stop_token_ids=[7], seed=3, n=2)
    kw = r.sampling_kwargs()
    assert kw["stop"] == ["END"] and kw["stop_token_ids"] == [7] and kw["top_k"] == 4 and kw["n"] == 2
    assert kw["ignore_eos"] is True and kw["min_tokens"] == 2 and kw["seed"] == 3 and kw["min_p"] == 0.1
    from shoal.engine.contracts import SamplingParams

    SamplingParams(max_tokens=4, **kw)  # every name is one SamplingParams knows


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "lots"})
    e = validation_error_to_api_error(ei.value)
    assert isinstance(e, APIError) and e.status == 400 and e.param == "max_tokens"
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("model, field, value", [(CompletionRequest, "suffix", "!"),
                                                (CompletionRequest, "logit_bias", {"7": 10}),
                                                (ChatCompletionRequest, "logit_bias", {"7": 10})])
def test_unimplemented_openai_fields_are_refused_by_name_only_when_set(model, field, value):
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    model.model_validate({**body, field: None})  # absent or empty: accepted
    model.model_validate({**body, field: type(value)()})
    with pytest.raises(ValidationError) as ei:
        model.model_validate({**body, field: value})
    e = validation_error_to_api_error(ei.value)
    assert e.status == 400 and e.param == field and str(e) == f"{field}: Value error, {field} is not supported"


def test_chat_request_details():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=3)
    assert r.requested_max_tokens() == 3 and r.requested_logprobs() is None
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert r.requested_logprobs() == 0


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_registry_is_per_app_and_reads_engine_stats():
    from prometheus_client import REGISTRY

    from shoal.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from shoal.engine.server.metrics import ServerMetrics

    stats = types.SimpleNamespace(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_kv_blocks=8,
                                  num_free_kv_blocks=6, num_preemptions_total=3, prefix_cache_queries_total=64,
                                  prefix_cache_hits_total=32, prompt_tokens_total=100, generation_tokens_total=50)
    engine = types.SimpleNamespace(snapshot=types.SimpleNamespace(stats=stats), num_waiting=lambda: 4,
                                   is_alive=lambda: True)
    a, b = ServerMetrics("m"), ServerMetrics("m")  # two apps in one process: no duplicate-registration error
    a.attach(engine)
    b.attach(engine)
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "ab", [4, 5], finish_reason="stop")], True,
                        RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=10.7,
                                       num_generation_tokens=2))
    a.on_first_token(0.2)
    a.on_inter_token(0.1, 2)
    a.on_finished(out, 12.0)
    text = a.render()[0].decode()
    assert 'shoal:num_requests_running{model_name="m"} 2.0' in text
    assert 'shoal:num_requests_waiting{model_name="m"} 4.0' in text
    assert 'shoal:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'shoal:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'shoal:prefix_cache_hits_total{model_name="m"} 32.0' in text
    assert 'shoal:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'shoal:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'shoal:request_queue_time_seconds_sum{model_name="m"} 0.5' in text
    assert 'shoal:e2e_request_latency_seconds_sum{model_name="m"} 2.0' in text
    assert "shoal:" not in "".join(m.name for m in REGISTRY.collect())


# ------------------------------------------------------------------------------------------ app while loading
async def _app_client(engine):
    from aiohttp.test_utils import TestClient, TestServer

    from shoal.engine.server.app import build_app
    from shoal.engine.server.metrics import ServerMetrics

    metrics = ServerMetrics(engine.model_name)
    metrics.attach(engine)
    client = TestClient(TestServer(build_app(engine, metrics)))
    await client.start_server()
    return client


async def test_health_while_loading_then_ready(llama_model):
    import threading

    from shoal.engine.core.async_engine import AsyncEngine
    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine import LLMEngine

    gate = threading.Event()

    def slow_load(config):  # the real engine, held back until the test has looked at the loading state
        gate.wait(30)
        return LLMEngine(config)

    eng = AsyncEngine(EngineConfig(model=str(llama_model), num_kv_blocks=64), engine_factory=slow_load)
    eng.start()
    client = await _app_client(eng)
    try:
        assert (await client.get("/startupz")).status == 503
        assert (await client.get("/readyz")).status == 503
        assert (await client.get("/livez")).status == 200  # loading is not dead
        assert (await client.get("/health")).status == 503  # vLLM's meaning: 200 only once ready to serve
        assert (await client.get("/metrics")).status == 200
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status == 503 and r.headers.get("Retry-After") and (await r.json())["error"]["code"] == "loading"
        gate.set()
        await eng.wait_loaded(60)
        for path in ("/startupz", "/readyz", "/livez", "/health"):
            assert (await client.get(path)).status == 200, path
        eng.shutdown()  # the loop has stopped: nothing will be served any more
        assert (await client.get("/health")).status == 503
    finally:
        gate.set()
        await client.close()
        eng.shutdown()


async def test_failed_load_fails_startup_and_liveness(tmp_path):
    from shoal.engine.core.async_engine import AsyncEngine, EngineDeadError
    from shoal.engine.config import EngineConfig

    eng = AsyncEngine(EngineConfig(model=str(tmp_path / "missing")))
    eng.start()
    with pytest.raises(EngineDeadError):
        await eng.wait_loaded(60)
    client = await _app_client(eng)
    try:
        r = await client.get("/startupz")
        assert r.status == 503 and (await r.json())["status"] == "failed"
        assert (await client.get("/livez")).status == 503
        assert (await client.get("/health")).status == 503
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status == 503
    finally:
        await client.close()


# ------------------------------------------------------------------------------------------ engine death
async def test_engine_death_errors_streams_fails_liveness_then_exits_1(llama_model):
    """serve() in-process over the real engine whose step starts raising (as when a parallel rank is lost)."""
    import threading

    import aiohttp

    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine import LLMEngine
    from shoal.engine.server.run import ServerOptions, serve

    from .conftest import free_port

    die = threading.Event()

    def factory(config):
        eng = LLMEngine(config)
        real = eng.step

        def step():
            if die.is_set():
                raise RuntimeError("lost tensor-parallel rank 3")
            return real()

        eng.step = step
        return eng

    port = free_port()
    opts = ServerOptions(host="127.0.0.1", port=port, access_log=False, fatal_exit_grace=1.0)
    task = asyncio.create_task(serve(EngineConfig(model=str(llama_model), num_kv_blocks=64), opts,
                                     engine_factory=factory))
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while True:
            assert not task.done(), task
            try:
                async with http.get(base + "/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        events = []
        async with http.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 3:
                        die.set()
        assert events[-1] == b"[DONE]"
        err = json.loads(events[-2])["error"]
        assert "lost tensor-parallel rank 3" in err["message"] and set(err) == {"message", "type", "param", "code"}
        async with http.get(base + "/livez") as r:
            assert r.status == 503
        async with http.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 503
    assert await asyncio.wait_for(task, 15) == 1


async def test_chat_template_flag_serves_a_model_without_one(llama_model, tmp_path):
    import shutil

    from shoal.engine.core.async_engine import AsyncEngine
    from shoal.engine.config import EngineConfig

    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = model / "tokenizer_config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "chat_template"}))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")

    for chat_template, expect in ((None, 400), (str(template), 200)):
        eng = AsyncEngine(EngineConfig(model=str(model), num_kv_blocks=64, chat_template=chat_template))
        eng.start()
        await eng.wait_loaded(60)
        client = await _app_client(eng)
        try:
            msgs = [{"role": "user", "content": "Hello there"}]
            r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
            body = await r.json()
            assert r.status == expect, body
            if expect == 400:
                assert "--chat-template" in body["error"]["message"]
            else:
                assert body["usage"]["completion_tokens"] == 3
                r = await client.post("/tokenize", json={"messages": msgs})
                toks = (await r.json())["tokens"]
                assert eng.tokenizer.decode(toks) == "[user] Hello there\n[assistant] "
                assert body["usage"]["prompt_tokens"] == len(toks)
        finally:
            await client.close()
            eng.shutdown()
