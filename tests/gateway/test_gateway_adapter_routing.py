"""Adapters are routed only where they are loaded: a gateway (round-robin, so every engine gets its turn) in front of
two real `shoal-engine serve` processes of which only one has the adapter. The gateway reads each engine's
/v1/models with its metrics, sends a request for the adapter only to engines listing it, holds one that no engine
lists yet until an engine loads it, and skips an engine that restarted without its adapters until it lists them
again. Base-model requests still go to every engine."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from shoal.engine.tools.tiny_lora import make_lora_adapter
from prockit import LoggedProcess

from .gwkit import Proc, engine_cmd, http, metric, wait_for

pytestmark = pytest.mark.slow

LORA_FLAGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")


def engine(model, port: int | None = None, *extra: str) -> LoggedProcess:
    """An engine with LoRA on (the adapters in `extra`); on `port` when given: the same engine restarted in place."""
    cmd = [*engine_cmd(model), *LORA_FLAGS, *extra]
    if port is None:
        return Proc(cmd)
    return LoggedProcess([*cmd, "--host", "127.0.0.1", "--port", str(port)], port, log_prefix="shoal-gw-test-")


@pytest.fixture(scope="module")
def adapter(fleet_model, tmp_path_factory):
    return make_lora_adapter(tmp_path_factory.mktemp("gw-adroute") / "ad", fleet_model, rank=4, seed=7)


@pytest.fixture(scope="module")
def pair(fleet_model, adapter):
    """[engine A with adapter `ad`, engine B without it]; a test may replace B (a restart in place)."""
    procs = [engine(fleet_model, None, "--lora-modules", f"ad={adapter}"), engine(fleet_model)]
    try:
        for p in procs:
            p.wait_ready(240)
        yield procs
    finally:
        for p in procs:
            p.stop()


def listed(p) -> set[str]:
    status, body, _ = http("GET", p.url + "/v1/models", timeout=10)
    assert status == 200, body
    return {m["id"] for m in json.loads(body)["data"] if m.get("parent")}


def load(p, adapter) -> None:
    status, body, _ = http("POST", p.url + "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(adapter)})
    assert status == 200, body


def unload(p) -> None:
    status, body, _ = http("POST", p.url + "/v1/unload_lora_adapter", {"lora_name": "ad"})
    assert status == 200, body


def lists_seen(gateway, engine_) -> float | None:
    """How many adapters the gateway last read in the engine's /v1/models (None: it does not know its list)."""
    key = f'shoal:gateway_backend_adapters{{backend="{engine_.url}"}}'
    return gateway.metrics().get(key)


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def served_by(gateway, engine_) -> float:
    return metric(gateway.metrics(), "shoal:gateway_requests_total", backend=engine_.url, code="200")


def asked_wrong_engine(gateway) -> float:
    """Requests an engine answered 404 that the gateway then retried on another (the fallback, not the routing)."""
    return metric(gateway.metrics(), "shoal:gateway_retries_total", reason="status_404")


def ask(gateway, model: str, n: int) -> None:
    """n completions for `model` through the gateway: every one answered (a 404 raises NotFoundError)."""
    for k in range(n):
        r = client(gateway).completions.create(model=model, prompt=f"request {k} about fish", max_tokens=2)
        assert r.model == model


def until_served_by(gateway, engine_, model: str, what: str) -> None:
    """Requests for `model` (each must succeed) until one lands on `engine_`: the gateway saw its new list."""
    before = served_by(gateway, engine_)

    def landed():
        ask(gateway, model, 1)
        return served_by(gateway, engine_) > before
    wait_for(landed, 30, what)


def test_adapter_goes_only_where_listed_then_everywhere_it_is(pair, adapter, start_gateway):
    a, b = pair
    gw = start_gateway(a.url, b.url, routing="round-robin")
    assert listed(a) == {"ad"} and listed(b) == set()
    wait_for(lambda: (lists_seen(gw, a), lists_seen(gw, b)) == (1, 0), 30, "the gateway to read both lists")
    before_b = served_by(gw, b)
    ask(gw, "ad", 6)  # round-robin would give B three of them, each a 404
    assert served_by(gw, b) == before_b, "a request for the adapter went to the engine without it"
    assert asked_wrong_engine(gw) == 0  # not even once, then retried elsewhere after its 404
    ask(gw, "tiny", 4)  # the base model: both engines in turn
    assert served_by(gw, b) == before_b + 2

    load(b, adapter)  # both engines serve it now: round-robin among them
    until_served_by(gw, b, "ad", "a request for the adapter on the engine that loaded it")
    a0, b0 = served_by(gw, a), served_by(gw, b)
    ask(gw, "ad", 4)
    assert (served_by(gw, a) - a0, served_by(gw, b) - b0) == (2, 2)


def test_engine_restarted_without_its_adapters_is_skipped_until_it_lists_them(pair, adapter, fleet_model,
                                                                             start_gateway):
    a, b = pair
    if "ad" not in listed(b):
        load(b, adapter)
    gw = start_gateway(a.url, b.url, routing="round-robin")
    wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy") == 2, 30, "the gateway polls both")
    until_served_by(gw, b, "ad", "the gateway to send the adapter to both engines")

    b.stop()  # B restarts in place (same address) without its adapters, as a crashed container does
    pair[1] = b = engine(fleet_model, b.port)
    b.wait_ready(240)
    wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy") == 2, 30, "the gateway sees B again")
    before_b = served_by(gw, b)
    ask(gw, "ad", 6)
    assert served_by(gw, b) == before_b, "the restarted engine got a request for an adapter it no longer has"
    assert asked_wrong_engine(gw) == 0
    ask(gw, "tiny", 2)
    assert served_by(gw, b) == before_b + 1  # it still serves the base model

    load(b, adapter)  # its adapters are back (the sidecar reloads them): it gets its turn again
    until_served_by(gw, b, "ad", "a request for the adapter on the engine that reloaded it")


def test_adapter_no_engine_lists_yet_is_held_until_one_does(pair, adapter, start_gateway):
    a, b = pair
    for p in pair:
        if "ad" not in listed(p):
            load(p, adapter)
    gw = start_gateway(a.url, b.url, routing="round-robin")
    wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy") == 2, 30, "the gateway polls both")
    until_served_by(gw, a, "ad", "the gateway to read the engines' lists")
    for p in pair:  # the adapter is reloaded everywhere (e.g. a new revision): for a moment no engine lists it
        unload(p)
    wait_for(lambda: (lists_seen(gw, a), lists_seen(gw, b)) == (0, 0), 30, "the gateway to see it unloaded")
    results: list = []

    def request():
        try:
            results.append(client(gw).completions.create(model="ad", prompt="held", max_tokens=2).model)
        except openai.APIError as e:
            results.append(e)
    t = threading.Thread(target=request)
    t.start()
    try:
        wait_for(lambda: metric(gw.metrics(), "shoal:gateway_adapter_wait_requests") == 1, 30,
                 "the request to wait for its adapter (not answered 404)")
        assert not results, results
        load(b, adapter)
    finally:
        t.join(60)
    assert results == ["ad"], results
    assert metric(gw.metrics(), "shoal:gateway_adapter_wait_requests") == 0
