"""In-process pieces of the server: CLI parsing and config mapping, protocol models, metrics, the load generator's
statistics, and AsyncEngine's failure handling (fatal step error, wedged step, drain, queue cap, cancellation)
over the real LLMEngine."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import types

import pytest
from pydantic import ValidationError

from shoal.engine import cli
from shoal.engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_to_api_error,
)


# ------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("text,value", [
    ("536870912", 536870912), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("512M", 512 * 2**20),
    ("1.5G", int(1.5 * 2**30)), ("2GB", 2 * 10**9), ("64kib", 64 * 1024), ("100 MB", 100 * 10**6),
])
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "-5", "0", "1XB", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_bytes(text)


def _serve_args(*argv):
    parser = cli.build_parser()
    return parser.parse_args(["serve", *argv])


def test_flags_map_to_engine_config():
    args = _serve_args(
        "--model", "/m", "--served-model-name", "svc", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--dtype", "half", "--max-model-len", "4k", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--block-size", "32", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "256MiB", "--num-kv-blocks", "99",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--attention-backend", "sdpa", "--enforce-eager",
        "--seed", "7", "--max-queue-len", "3", "--scheduling-policy", "priority", "--trust-remote-code",
        "--revision", "main", "--tokenizer", "/t", "--device", "cpu", "--chat-template", "{{ x }}",
    )
    c = cli.engine_config_from_args(args)
    assert (c.model, c.served_model_name, c.model_name) == ("/m", "svc", "svc")
    assert (c.tensor_parallel_size, c.pipeline_parallel_size, c.dtype) == (2, 2, "float16")
    assert (c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens, c.block_size) == (4000, 8, 512, 32)
    assert (c.gpu_memory_utilization, c.kv_cache_memory, c.num_kv_blocks) == (0.5, 256 * 2**20, 99)
    assert (c.enable_prefix_caching, c.enable_chunked_prefill, c.attention_backend, c.enforce_eager) == \
           (False, False, "sdpa", True)
    assert (c.seed, c.max_queue_len, c.scheduling_policy, c.trust_remote_code) == (7, 3, "priority", True)
    assert (c.revision, c.tokenizer, c.device, c.chat_template) == ("main", "/t", "cpu", "{{ x }}")


def test_unset_flags_keep_config_defaults():
    from shoal.engine.config import EngineConfig

    c = cli.engine_config_from_args(_serve_args("--model", "/m"))
    d = EngineConfig(model="/m")
    assert c == d
    args = _serve_args("--model", "/m", "--enable-prefix-caching", "--enable-chunked-prefill")
    c = cli.engine_config_from_args(args)
    assert c.enable_prefix_caching and c.enable_chunked_prefill


def test_without_model_serves_the_demo_model(monkeypatch, tmp_path):
    import shoal.engine.tools.tiny_model as demo

    monkeypatch.setattr(demo, "ensure_demo_model", lambda: tmp_path / "demo-llama")
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))  # no SmolLM2 GGUF there: the random tiny model
    monkeypatch.delenv("SHOAL_DEMO_GGUF", raising=False)
    c = cli.engine_config_from_args(_serve_args())
    assert c.model == str(tmp_path / "demo-llama") and c.model_name == cli.DEMO_SERVED_NAME


def test_help_says_kv_cache_is_sized_on_cpu_by_bytes(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-memory" in out and "sized on CPU" in out and "512MiB" in out
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enable-chunked-prefill", "--attention-backend", "--api-key-file",
                 "--shutdown-timeout", "--max-queue-len", "--num-kv-blocks", "--served-model-name", "--log-level"):
        assert flag in out, flag


def test_config_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--model", "/m", "--block-size", "0"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--block-size" in err and "Traceback" not in err


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    ns = argparse.Namespace(api_key=None, api_key_file=None)
    assert cli.resolve_api_key(ns) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert cli.resolve_api_key(argparse.Namespace(api_key=None, api_key_file=str(f))) == "from-file"
    assert cli.resolve_api_key(argparse.Namespace(api_key="flag", api_key_file=str(f))) == "flag"
    f.write_text("  \n")
    with pytest.raises(ValueError):
        cli.resolve_api_key(argparse.Namespace(api_key=None, api_key_file=str(f)))
    monkeypatch.delenv("SHOAL_API_KEY")
    assert cli.resolve_api_key(ns) is None


def test_bench_throughput_delegates(monkeypatch):
    seen = {}
    fake = types.ModuleType("shoal.engine.tools.bench_throughput")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "shoal.engine.tools.bench_throughput", fake)
    import shoal.engine.tools as tools

    # `from shoal.engine.tools import bench_throughput` reads the package attribute once the real one was imported
    monkeypatch.setattr(tools, "bench_throughput", fake, raising=False)
    assert cli.main(["bench", "throughput", "--model", "/m", "--num-prompts", "4"]) == 0
    assert seen["argv"] == ["--model", "/m", "--num-prompts", "4"]


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


def test_chat_request_details():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=3)
    assert r.requested_max_tokens() == 3 and r.requested_logprobs() is None
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert r.requested_logprobs() == 0


# ------------------------------------------------------------------------------------------ metrics / bench
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


def test_bench_statistics():
    import random

    from shoal.engine.tools import bench_serve

    p = bench_serve.percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == 50.5
    assert bench_serve.percentiles([])["p50"] is None
    d1 = bench_serve.arrival_delays(random.Random(1), 1000, 10.0, "poisson")
    assert d1 == bench_serve.arrival_delays(random.Random(1), 1000, 10.0, "poisson")
    assert 0.08 < sum(d1) / len(d1) < 0.12
    assert bench_serve.arrival_delays(random.Random(1), 3, 4.0, "fixed") == [0.25] * 3
    assert bench_serve.arrival_delays(random.Random(1), 3, float("inf"), "poisson") == [0.0] * 3
    lens = bench_serve.sample_lengths(random.Random(0), 100, 0.5, 200)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 10


# ------------------------------------------------------------------------------------------ AsyncEngine
@pytest.fixture
async def async_engine(llama_model):
    from shoal.engine.core.async_engine import AsyncEngine
    from shoal.engine.config import EngineConfig

    eng = AsyncEngine(EngineConfig(model=str(llama_model), num_kv_blocks=64, max_queue_len=2))
    eng.start()
    await eng.wait_loaded(120)
    yield eng
    eng.shutdown()


def _params(**kw):
    from shoal.engine.contracts import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **kw})


async def test_async_engine_generates_and_cancellation_aborts(async_engine):
    eng = async_engine
    outs = [o async for o in eng.generate([5, 6, 7], _params(), "a")]
    # Deltas: every output carries only its new tokens; together they are the 8 generated.
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(o.outputs[0].token_ids for o in outs) and sum(len(o.outputs[0].token_ids) for o in outs) == 8
    agen = eng.generate([5, 6, 7], _params(max_tokens=400, ignore_eos=True), "b")
    await agen.__anext__()
    await agen.aclose()  # GeneratorExit -> abort
    deadline = time.monotonic() + 5
    while (eng.num_in_flight() or eng.snapshot.stats.num_running) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert eng.num_in_flight() == 0 and eng.snapshot.stats.num_running == 0
    assert eng.snapshot.stats.num_free_kv_blocks == eng.snapshot.stats.num_kv_blocks

    async def consume():
        async for _ in eng.generate([5, 6, 7], _params(max_tokens=400, ignore_eos=True), "c"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()  # handler cancelled (client gone) -> abort
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while eng.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert eng.num_in_flight() == 0
    with pytest.raises(ValueError):  # bad input comes back as ValueError (-> 400)
        await eng.add_request("d", [5] * 600, _params())


async def test_async_engine_drain_and_queue_cap(async_engine):
    from shoal.engine.core.async_engine import DrainingError, QueueFullError

    eng = async_engine
    eng.max_queue_len = 1
    eng._lock.acquire()
    eng._pending_adds += 1  # one request handed over but not yet in the engine's queue
    eng._lock.release()
    assert eng.queue_full() and not eng.is_ready()
    with pytest.raises(QueueFullError):
        await eng.add_request("q", [5, 6], _params())
    with eng._lock:
        eng._pending_adds -= 1
    assert eng.is_ready()
    eng.start_draining()
    assert not eng.is_ready() and eng.is_alive()
    with pytest.raises(DrainingError):
        await eng.add_request("x", [5, 6], _params())


async def test_async_engine_wedged_step_fails_liveness(async_engine):
    eng = async_engine
    real = eng.engine.step

    def slow():
        time.sleep(1.5)
        eng.engine.step = real
        return real()

    eng.heartbeat_timeout = 0.5
    eng.engine.step = slow
    stream = await eng.add_request("w", [5, 6, 7], _params(max_tokens=2))
    deadline = time.monotonic() + 3
    while eng.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not eng.is_alive()  # heartbeat stale while the step hangs
    outs = [o async for o in stream]
    assert outs[-1].finished
    eng.heartbeat_timeout = 5.0
    deadline = time.monotonic() + 5
    while not eng.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert eng.is_alive()  # fresh again once the loop moves


async def test_async_engine_fatal_step_error_kills_loop(async_engine):
    from shoal.engine.core.async_engine import EngineDeadError

    eng = async_engine

    def boom():
        raise RuntimeError("CUDA error: device-side assert")

    eng.engine.step = boom
    stream = await eng.add_request("f", [5, 6, 7], _params())
    with pytest.raises(EngineDeadError, match="device-side assert"):
        async for _ in stream:
            pass
    assert not eng.is_alive() and not eng.is_ready() and isinstance(eng.fatal_error, RuntimeError)
    with pytest.raises(EngineDeadError):
        await eng.add_request("g", [5, 6, 7], _params())


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
