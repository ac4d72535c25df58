"""Long requests through a real gateway and real engines: a non-streaming generation says nothing until it ends,
so the gateway's silence bound (--read-timeout) must not cut it, and it must never run twice."""

from __future__ import annotations

import json
import time

import pytest
from .gwkit import Proc, engine_cmd, http, metric, running

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def two_engines(fleet_model):
    with running([Proc(engine_cmd(fleet_model)) for _ in range(2)]) as procs:
        yield procs

def test_a_non_streaming_generation_longer_than_the_read_timeout_runs_once(two_engines, start_gateway):
    # 0.2 s of allowed silence stands for the old 600 s read timeout; the generation below takes several times that
    # (1.4 s on a fast CPU: a longer bound made the check below depend on the machine's speed)
    gw = start_gateway(*(e.url for e in two_engines), routing="round-robin",
                       extra=("--read-timeout", "0.2", "--response-timeout", "120"))
    before = sum(metric(e.metrics(), "shoal:request_success_total") for e in two_engines)
    started = time.monotonic()
    status, body, _ = http("POST", gw.url + "/v1/completions", timeout=120, body={
        "model": "tiny", "prompt": "tell me a long story", "max_tokens": 1500, "ignore_eos": True})
    elapsed = time.monotonic() - started
    assert status == 200, body[:500]
    assert elapsed > 0.6, f"the generation took only {elapsed:.2f}s: too short to test the timeout"

    assert json.loads(body)["usage"]["completion_tokens"] == 1500
    after = sum(metric(e.metrics(), "shoal:request_success_total") for e in two_engines)
    assert after - before == 1  # one engine ran it, once
    samples = gw.metrics()
    assert metric(samples, "shoal:gateway_retries_total") == 0
    assert metric(samples, "shoal:gateway_backend_circuit_open") == 0
