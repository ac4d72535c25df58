"""The start-up breakdown of a real `shoal-engine serve`: a log line at ready, /startupz's `startup` and the
shoal:startup_seconds gauge say the same seconds per phase, and the lazy phases (decode graph warm-up and
capture) appear once the first decode steps ran."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest
from prockit import wait_for

from .conftest import metric


def test_startup_breakdown_is_logged_served_and_exported(start_server, llama_model):
    spawned = time.monotonic()
    server = start_server(llama_model, "--max-model-len", "64", "--device", "cpu")
    status, body = server.get("/startupz")
    seen = time.monotonic() - spawned
    startup = json.loads(body)["startup"]
    assert status == 200
    # the process's age on the boot clock: never more than the test saw pass (a start time built from /proc/stat's
    # whole-second btime read up to a second long)
    assert 0 < startup["total"] <= seen + 0.05, (startup, seen)
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


def test_garbage_collection_is_held_until_ready_then_frozen():
    """serve holds the cyclic collector through imports and the load (startup.hold_gc), and ready() resumes it
    with the start's objects frozen out of later collections (a fresh interpreter: the collector is global)."""
    code = ("import gc; from shoal.engine import startup; startup.hold_gc(); assert not gc.isenabled(); "
            "import json; startup.ready(); print(json.dumps([gc.isenabled(), gc.get_freeze_count()]))")
    enabled, frozen = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                                text=True).stdout)
    assert enabled and frozen > 1000
    # a serve that fails before serving (here: a bad flag, in this process) gives the collector back too
    from shoal.engine import cli

    assert gc.isenabled()
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", "/nonexistent", "--response-store-size", "0"])
    assert gc.isenabled()


def test_the_process_age_is_on_the_boot_clock():
    """`process` is the interpreter's age when main runs: never more than the wall time its whole run took."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "from shoal.engine import startup; print(startup.process_age())"],
                         check=True, capture_output=True, text=True).stdout
    wall = time.monotonic() - t0
    assert 0 < float(out) <= wall + 0.02, (out, wall)  # (/proc's start ticks are 10 ms)


def test_startupz_holds_a_probe_until_the_model_is_loaded(start_server, llama_model):
    """?wait=S is the startup probe's long poll: a loading engine answers it the moment the model is loaded (200),
    or with 503 once S seconds passed; a wait that is no number of seconds from 0 to 30 is a 400."""
    server = start_server(llama_model, "--max-model-len", "64", "--device", "cpu", wait=False)
    wait_for(lambda: server.get("/livez", timeout=1)[0], 120, "the server listening")  # (it listens, then loads)
    assert server.get("/startupz")[0] == 503  # loading: transformers' config machinery alone takes a second
    t0 = time.monotonic()
    assert server.get("/startupz?wait=0.01")[0] == 503 and time.monotonic() - t0 < 5
    status, body = server.get("/startupz?wait=30", timeout=60)
    assert status == 200 and json.loads(body)["status"] == "started"
    assert server.get("/readyz")[0] == 200
    for bad in ("x", "31", "-1", "nan"):
        status, body = server.get(f"/startupz?wait={bad}")
        assert status == 400 and json.loads(body)["error"]["param"] == "wait", (bad, body)
