"""Adapter affinity with real engines: three `shoal-engine serve` replicas register the same three LoRA adapters but
keep one loaded each (--max-cpu-loras 1); the gateway routes each adapter's requests to the engine where it is
resident (read from the engines' /metrics), so no engine reloads an adapter, where round-robin reloads them."""

from __future__ import annotations

import openai
import pytest

from shoal.engine.tools.tiny_lora import make_lora_adapter

from .gwkit import Proc, engine_cmd, metric, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_fleet(fleet_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gw-loras")
    modules = [f"a{i}={make_lora_adapter(root / f'a{i}', fleet_model, rank=4, seed=i)}" for i in range(3)]
    procs = [Proc([*engine_cmd(fleet_model), "--enable-lora", "--lora-modules", *modules, "--max-loras", "1",
                   "--max-cpu-loras", "1", "--max-lora-rank", "8"]) for _ in range(3)]
    try:
        for p in procs:
            p.wait_ready()
        # Registering a0, a1, a2 left a2 resident everywhere; give engine i adapter a_i.
        for i, p in enumerate(procs[:2]):
            openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0).completions.create(
                model=f"a{i}", prompt="warm", max_tokens=1)
        for i, p in enumerate(procs):
            wait_for(lambda: metric(p.metrics(), "shoal:lora_resident_info", resident_lora_adapters=f"a{i}") > 0,
                     30, f"a{i} resident on engine {i}")
        yield procs
    finally:
        for p in procs:
            p.stop()


def loads(procs) -> float:
    return sum(metric(p.metrics(), "shoal:lora_loads_total") for p in procs)


def run(gateway: Proc, n: int) -> None:
    c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for k in range(n):
        model = f"a{k // 2 % 3}"  # pairs of requests per adapter: out of step with any rotation over 3 engines
        r = c.completions.create(model=model, prompt=f"request {k}: tell me about fish", max_tokens=2)
        assert r.model == model


def test_adapter_affinity_beats_round_robin_on_adapter_hits(lora_fleet, start_gateway):
    urls = [p.url for p in lora_fleet]
    affinity = start_gateway(*urls, routing="prefix-load")
    wait_for(lambda: metric(affinity.metrics(), "shoal:gateway_backend_healthy") == 3, 30, "the gateway polls")
    before = loads(lora_fleet)
    run(affinity, 12)
    assert loads(lora_fleet) == before  # every request found its adapter loaded
    assert metric(affinity.metrics(), "shoal:gateway_routing_decisions_total", decision="lora-affinity") == 12
    round_robin = start_gateway(*urls, routing="round-robin")
    before = loads(lora_fleet)
    run(round_robin, 12)
    assert loads(lora_fleet) - before >= 6  # most requests landed where another adapter was loaded
