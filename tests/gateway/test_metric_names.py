"""Each runtime's load gauges, as the gateway's poller and the autoscaler read them (operator/gateway/metric_names.py)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from webkit import lone_backend

from shoal.operator.gateway import metric_names
from shoal.operator.gateway.cli import build_parser, config_from_args
from shoal.operator.gateway.poller import Poller, parse_load
from shoal.operator.autoscaler import metric_sums

# The exposition of a vLLM 0.32 server (V1 engine: one label set per engine core), trimmed to what matters here.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llm"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llm"} 5.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="llm",reason="capacity"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llm"} 0.25
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llm"} 640.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09
"""
VLLM_V0_TEXT = ('vllm:num_requests_running{model_name="llm"} 1.0\nvllm:num_requests_waiting{model_name="llm"} 0.0\n'
                'vllm:gpu_cache_usage_perc{model_name="llm"} 0.75\n')
SGLANG_TEXT = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="llm"} 7.0\n'
               'sglang:num_queue_reqs{model_name="llm"} 2.0\nsglang:token_usage{model_name="llm"} 0.5\n'
               'sglang:cache_hit_rate{model_name="llm"} 0.9\n')
# Shoal's engine also exports vLLM's names: reading a Shoal engine must not count its load twice.
SHOAL_TEXT = ('shoal:num_requests_running{model_name="llm"} 4.0\nshoal:num_requests_waiting{model_name="llm"} 1.0\n'
              'shoal:kv_cache_usage_perc{model_name="llm"} 0.5\nshoal:num_waiting_prefill_tokens{model_name="llm"} 96\n'
              'vllm:num_requests_running{model_name="llm"} 4.0\nvllm:num_requests_waiting{model_name="llm"} 1.0\n'
              'vllm:kv_cache_usage_perc{model_name="llm"} 0.5\n')


@pytest.mark.parametrize("runtime, text, expected", [
    ("vllm", VLLM_TEXT, {"running": 3.0, "waiting": 5.0, "kv_usage": 0.25, "waiting_prefill_tokens": 0.0}),
    ("vllm", VLLM_V0_TEXT, {"running": 1.0, "waiting": 0.0, "kv_usage": 0.75, "waiting_prefill_tokens": 0.0}),
    ("sglang", SGLANG_TEXT, {"running": 7.0, "waiting": 2.0, "kv_usage": 0.5, "waiting_prefill_tokens": 0.0}),
    ("shoal", SHOAL_TEXT, {"running": 4.0, "waiting": 1.0, "kv_usage": 0.5, "waiting_prefill_tokens": 96.0}),
])
def test_the_line_scan_and_the_full_parse_read_the_same_load_per_runtime(runtime, text, expected):
    names = metric_names.for_runtime(runtime)
    assert metric_names.scan(text, names) == expected  # the gateway's scan, 4x a second per engine
    assert metric_names.load_from_sums(metric_sums(text), names) == expected  # the autoscaler's Prometheus parse


def test_another_runtimes_names_are_not_load():
    # a vLLM fleet's gateway configured as shoal (or the reverse) sees no load rather than a wrong one
    assert parse_load(VLLM_TEXT) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    assert parse_load(SHOAL_TEXT, metric_names.VLLM) == {"running": 4.0, "waiting": 1.0, "kv_usage": 0.5}
    assert parse_load(SGLANG_TEXT, metric_names.VLLM) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}


def test_kv_usage_is_the_max_over_label_sets_and_requests_the_sum():
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
            'vllm:num_requests_waiting{engine="0"} NaN\n')
    assert parse_load(text, metric_names.VLLM) == {"running": 5.0, "waiting": 0.0, "kv_usage": 0.6}


def test_unknown_runtime_is_a_clear_error_and_the_cli_knows_each_runtime():
    with pytest.raises(ValueError, match="unknown engine runtime 'tgi'.*shoal, vllm, sglang"):
        metric_names.for_runtime("tgi")
    assert config_from_args(build_parser().parse_args(["--endpoint", "http://e:8000"])).runtime == "shoal"
    args = build_parser().parse_args(["--endpoint", "http://e:8000", "--runtime", "vllm"])
    assert config_from_args(args).runtime == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--endpoint", "http://e:8000", "--runtime", "tgi"])


async def test_the_poller_asks_a_vllm_engine_for_health_and_reads_its_gauges():
    asked: list[str] = []

    async def health(request):
        asked.append(request.path)
        return web.Response(text="")  # vLLM's /health: 200, empty body

    async def metrics(request):
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/health", health)  # no /readyz: a poll of it would be a 404, i.e. not ready
    app.router.add_get("/metrics", metrics)
    engine, backends, b = await lone_backend(app)
    try:
        async with aiohttp.ClientSession() as session:
            await Poller(backends, session, timeout=2.0, metrics=metric_names.VLLM).poll(b)
            assert asked == ["/health"] and b.ready is True
            assert (b.running, b.waiting, b.kv_usage) == (3.0, 5.0, 0.25)
            await Poller(backends, session, timeout=2.0).poll(b)  # as a Shoal engine: /readyz is a 404
            assert b.ready is False
    finally:
        await engine.close()
