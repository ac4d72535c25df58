"""The canary split in the real `shoal-gateway --service` process, on the API emulator (tests/kubekit.py).

The test plays the EndpointSlice controller: slices of the engines Service carry the Service's labels (the canary's
share, serving.shoal.dev/canary-percent) and each endpoint's targetRef names its pod (`llm-canary-...` for the
canary's). The engines are stand-ins (aiohttp on 127.0.0.1) that record what reached them and can answer 500; the
operator-driven version with real engines is tests/operator/test_canary_e2e.py.
"""

from __future__ import annotations

import random
import sys
import uuid

import pytest
from fleetkit import StandInChatEngines as Engines
from promkit import metric, parse_metrics
from prockit import LoggedProcess, free_port, http, wait_for

from shoal.operator import contract
from shoal.operator.gateway import canary


def endpoint_slice(pod: str, port: int, percent: int) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"llm-engines-{pod}", "labels": {
                contract.L_SERVICE_NAME: "llm-engines", contract.L_ISVC: "llm",
                contract.L_CANARY_PERCENT: str(percent)}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                           "targetRef": {"kind": "Pod", "name": pod}}]}


PODS = ["llm-7bd9f8c6d4-aaaaa", "llm-7bd9f8c6d4-bbbbb", "llm-canary-5d8c9b7f6-ccccc"]


@pytest.fixture
def fleet(api):
    ns = "gw-" + uuid.uuid4().hex[:8]
    engines = Engines(PODS)
    for pod, port in engines.ports.items():
        api.create("endpointslices", ns, endpoint_slice(pod, port, 20))
    port = free_port()
    gw = LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", "--service", "llm-engines", "--namespace",
                        ns, "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.1",
                        "--log-level", "warning"], port)
    try:
        gw.wait_ready(30, "/readyz")
        wait_for(lambda: gateway_metric(gw.url, "shoal:gateway_ready_backends") == 3, 30, "three engines discovered")
        yield api, ns, engines, gw.url
    finally:
        gw.stop(timeout=20)
        engines.close()


def gateway_metric(url: str, name: str, **labels) -> float:
    status, raw, _ = http("GET", url + "/metrics", timeout=5)
    assert status == 200
    return metric(parse_metrics(raw.decode()), name, **labels)


def chat(url: str, opening: str, turns: int = 1) -> int:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": opening}]
    for turn in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    status, _raw, _ = http("POST", url + "/v1/chat/completions", {"model": "chat", "messages": messages}, timeout=30)
    return status


def test_conversation_keys_are_sticky_and_the_split_is_exact_in_expectation():
    rng = random.Random(7)
    system = {"role": "system", "content": "shared system prompt " * 20}
    keys = [canary.conversation_key({}, {"messages": [system, {"role": "user", "content": f"q{rng.random()}"}]})
            for _ in range(20000)]
    share = sum(canary.revision_for(k, 20) == "canary" for k in keys) / len(keys)
    assert 0.19 < share < 0.21
    # every later turn of a conversation has the opening's key; a session header wins over the body
    opening = [system, {"role": "user", "content": "hi"}]
    later = opening + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    assert canary.conversation_key({}, {"messages": opening}) == canary.conversation_key({}, {"messages": later})
    assert canary.conversation_key({"X-Session-Id": "s1"}, {"messages": opening}) == \
        canary.conversation_key({"X-Session-Id": "s1"}, {"messages": later[:1]})
    grown = "Once upon a time " * 40  # past PROMPT_KEY_CHARS: later turns repeat the key's characters
    assert canary.conversation_key({}, {"prompt": grown}) == canary.conversation_key({}, {"prompt": grown + "the end"})
    assert canary.revision_for(b"x", 0) == "stable" and canary.revision_for(b"x", 100) == "canary"


def test_a_canary_at_20_percent_gets_20_percent_of_500_conversations_each_on_one_revision(fleet):
    api, ns, engines, url = fleet
    for i in range(500):
        assert chat(url, f"conversation {i}") == 200  # fixed openings: a reproducible split
    canary_share = engines.served("llm-canary-") / 500
    print(f"canary served {canary_share:.1%} of 500 conversations (target 20%)")
    assert 0.15 <= canary_share <= 0.25, canary_share
    # second and third turns stay where their conversation started
    openings = {pod: list(seen[:20]) for pod, seen in engines.seen.items()}
    for pod, firsts in openings.items():
        for opening in firsts:
            assert chat(url, opening, turns=3) == 200
    for pod, firsts in openings.items():
        assert engines.seen[pod][-len(firsts):] == firsts if firsts else True, pod
    assert gateway_metric(url, "shoal:gateway_revision_requests_total", revision="canary", outcome="ok") == \
        engines.served("llm-canary-")
    # the share moves with the Service's label, on the same watch: 0 sends nothing more to the canary
    for pod, port in engines.ports.items():
        api.patch("endpointslices", ns, f"llm-engines-{pod}", {"metadata": {"labels": {
            contract.L_CANARY_PERCENT: "0"}}})
    before = engines.served("llm-canary-")

    def canary_idle() -> bool:
        sent = engines.served("llm-canary-")
        for i in range(10):
            chat(url, f"probe {uuid.uuid4().hex}")
        return engines.served("llm-canary-") == sent

    wait_for(canary_idle, 30, "the gateway to apply a share of 0")
    assert engines.served("llm-canary-") - before <= 10


def test_a_failing_canarys_errors_are_counted_per_revision(fleet):
    _api, _ns, engines, url = fleet
    engines.failing.add(PODS[2])
    statuses = [chat(url, f"c{i} {uuid.uuid4().hex}") for i in range(100)]
    failed = statuses.count(500)
    assert failed == engines.served("llm-canary-") and 5 <= failed <= 40  # only the canary's conversations
    assert gateway_metric(url, "shoal:gateway_revision_requests_total", revision="canary", outcome="error") == failed
    assert gateway_metric(url, "shoal:gateway_revision_requests_total", revision="stable", outcome="ok") == 100 - failed
    assert gateway_metric(url, "shoal:gateway_revision_first_byte_seconds_count", revision="stable") == 100 - failed


def test_the_pool_keeps_a_request_on_its_revision_and_falls_back_only_without_its_engines():
    from shoal.operator.gateway.admission import Ticket
    from shoal.operator.gateway.backends import BackendSet
    from shoal.operator.gateway.discovery import canary_percent, revisions
    from shoal.operator.gateway.pool import Pool
    from shoal.operator.gateway.routing import make_router

    slices = {pod: endpoint_slice(pod, port, 25) for pod, port in zip(PODS, (8001, 8002, 8003))}
    backends = BackendSet()
    backends.replace({"http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"})
    backends.set_revisions(revisions(slices), canary_percent(slices))
    assert backends.split and backends.canary_percent == 25
    assert {b.url: b.revision for b in backends.all()} == {
        "http://127.0.0.1:8001": "stable", "http://127.0.0.1:8002": "stable", "http://127.0.0.1:8003": "canary"}
    pool = Pool(backends, make_router("least-load"))
    for b in backends.all():
        b.ready = True
        b.last_answer = b.last_ok = 1e18  # fresh: nobody stalled
    picks = {pool.pick(Ticket(revision="canary")).url for _ in range(5)}
    assert picks == {"http://127.0.0.1:8003"}  # however loaded it gets
    assert "http://127.0.0.1:8003" not in {pool.pick(Ticket(revision="stable")).url for _ in range(5)}
    # the canary cannot take requests (not ready): its conversations go to the stable engines, none is refused
    next(b for b in backends.all() if b.revision == "canary").ready = False
    assert pool.pick(Ticket(revision="canary")).revision == "stable"
    # a share of 0 without canary engines: no split at all
    backends.set_revisions({}, 0)
    assert not backends.split
