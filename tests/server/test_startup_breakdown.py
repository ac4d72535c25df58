"""The start-up breakdown of a real `shoal-engine serve`: a log line at ready, /startupz's `startup` and the
shoal:startup_seconds gauge say the same seconds per phase, and the lazy phases (decode graph warm-up and
capture) appear once the first decode steps ran."""

from __future__ import annotations

import json
import time

from .conftest import metric


def test_startup_breakdown_is_logged_served_and_exported(start_server, llama_model):
    server = start_server(llama_model, "--max-model-len", "64", "--device", "cpu")
    status, body = server.get("/startupz")
    startup = json.loads(body)["startup"]
    assert status == 200
    for phase in ("process", "imports", "config", "tokenizer", "weights", "kv_cache", "other", "total"):
        assert phase in startup, f"{phase} missing from {startup}"
    assert 0 < startup["weights"] < startup["total"] and startup["process"] >= 0
    assert abs(sum(v for k, v in startup.items() if k != "total") - startup["total"]) < 0.01  # they add up
    m = server.metrics()
    assert metric(m, "shoal:startup_seconds", phase="weights") == startup["weights"]
    assert metric(m, "shoal:startup_seconds", phase="total") == startup["total"]
    deadline = time.monotonic() + 30
    while "start-up: process" not in server.logs():
        assert time.monotonic() < deadline, "waited for the start-up log line"
        time.sleep(0.05)
    line = next(x for x in server.logs().splitlines() if "start-up: process" in x)
    assert "weights" in line and "total" in line
    # decode steps: on CPU the first ones warm up and record the decode graph (cpu-graph, the default)
    assert server.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                           "temperature": 0})[0] == 200
    later = json.loads(server.get("/startupz")[1])["startup"]
    if "graph_capture" in later:  # capture is the default on CPU; a backend that cannot capture skips it
        assert later["warmup"] > 0 and later["graph_capture"] > 0
    assert later["total"] == startup["total"]  # fixed at ready
