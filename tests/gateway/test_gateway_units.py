"""The gateway's parts without engines: prompt hashing, routing decisions, CLI errors, admission limits, holding
requests while no engine is ready. Fast; the fleet tests cover the real thing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from webkit import lone_backend, serve, started
from yarl import URL

from shoal.engine.server.keys import KeySet
from shoal.operator.gateway.backends import Backend, BackendSet, HealthPolicy
from shoal.operator.gateway.discovery import ready_urls
from shoal.operator.gateway.poller import Poller, parse_load
from shoal.operator.gateway.prefix import block_hashes, render_prompt
from shoal.operator.gateway.proxy import Gateway, GatewayConfig, build_app
from shoal.operator.gateway.routing import make_router, prefix_load


def test_gateway_imports_no_torch():
    code = ("import sys, shoal.operator.gateway.cli, shoal.operator.gateway.proxy, shoal.operator.gateway.discovery, "
            "shoal.operator.gateway.fleet, shoal.operator.gateway.wake, shoal.operator.gateway.own_service; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_block_hashes_chain_like_the_prefix_cache():
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 64, 64, 100)
    b = block_hashes("x" * 64 + "y" * 64 + "w" * 64, 64, 100)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # A later block's hash depends on every earlier block, not just on its own text.
    c = block_hashes("q" * 64 + "y" * 64, 64, 100)
    assert c[1] != a[1]
    assert block_hashes("short", 64, 100) == []
    assert len(block_hashes("x" * 64 * 10, 64, 4)) == 4  # bounded work on long prompts
    assert block_hashes("é" * 128, 64, 10) != block_hashes("e" * 128, 64, 10)


def test_block_hashes_agree_across_processes():
    code = "from shoal.operator.gateway.prefix import block_hashes; print(block_hashes('ab' * 100, 64, 10)[-1].hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip() == block_hashes("ab" * 100, 64, 10)[-1].hex()


def test_render_prompt():
    chat = {"model": "m", "messages": [{"role": "system", "content": "S"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    text = render_prompt("/v1/chat/completions", chat)
    assert text.startswith("m") and "S" in text and "hi" in text
    # The same messages for another model are a different prefix.
    assert render_prompt("/v1/chat/completions", dict(chat, model="n")) != text
    assert render_prompt("/v1/completions", {"model": "m", "prompt": ["first", "second"]}).endswith("first")
    assert render_prompt("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}).endswith("1,2,3")
    assert render_prompt("/v1/completions", {"prompt": None}) is None
    assert render_prompt("/v1/chat/completions", {"messages": "oops"}) is None
    assert render_prompt("/v1/completions", ["not", "an", "object"]) is None


def test_a_conversation_about_one_image_keeps_its_prefix():
    """Image parts count in the prompt's hashes by a digest of their URL: turn 2 about the same picture extends
    turn 1's chain through the image, and lands on the engine holding it; another picture under the same text
    shares only the blocks before the image."""
    def image(n):
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + chr(65 + n) * 200_000}}

    def hashes(messages):
        return block_hashes(render_prompt("/v1/chat/completions", {"model": "m", "messages": messages}), 16, 1000)

    system = {"role": "system", "content": "You describe pictures. " * 4}
    turn1 = [system, {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image(0)]}]
    turn2 = turn1 + [{"role": "assistant", "content": "A cat on a mat, sleeping."},
                     {"role": "user", "content": "And what colour is the cat?"}]
    other = [system, {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image(1)]}]
    h1, h2, h_other = hashes(turn1), hashes(turn2), hashes(other)
    assert len(h1) < 20  # a digest, not 200 KB of base64
    assert h2[:len(h1)] == h1
    shared = next(i for i, (a, b) in enumerate(zip(h1, h_other)) if a != b)
    assert 0 < shared < len(h1)  # the text before the image is shared, the image's blocks are not
    r, bs, now = prefix_load(), backends(3), time.monotonic()
    r.record(bs[1], h1, now)
    r.record(bs[2], h_other, now)
    pick = r.pick(bs, h2, now)
    assert pick.backend is bs[1] and pick.decision == "affinity" and pick.matched_blocks == len(h1)


def backends(n: int) -> list[Backend]:
    policy = HealthPolicy()
    return [Backend(f"http://10.0.0.{i}:8000", policy) for i in range(n)]


def test_prefix_load_prefers_the_engine_holding_the_longest_prefix():
    r, bs, now = prefix_load(), backends(3), time.monotonic()
    shared = block_hashes("s" * 640, 64, 100)
    r.record(bs[2], shared[:4], now)
    r.record(bs[1], shared, now)  # holds the whole chain
    pick = r.pick(bs, shared + block_hashes("t" * 64, 64, 1), now)
    assert pick.backend is bs[1] and pick.decision == "affinity" and pick.matched_blocks == len(shared)
    # The holder is busy beyond the slack: the next-longest holder that is within the bound wins.
    bs[1].inflight = 5
    pick = r.pick(bs, shared, now)
    assert pick.backend is bs[2] and pick.matched_blocks == 4


def test_prefix_load_spills_a_hot_prefix_under_bounded_load():
    r, bs, now = prefix_load(load_factor=1.25, affinity_slack=0), backends(3), time.monotonic()
    hashes = block_hashes("hot prefix " * 30, 64, 100)
    picks = []
    for _ in range(9):
        pick = r.pick(bs, hashes, now)
        r.record(pick.backend, hashes, now)
        pick.backend.inflight += 1
        picks.append(pick.decision)
    assert sorted(b.inflight for b in bs) == [3, 3, 3]  # c=1.25 over 9 requests: at most ceil(1.25*9/3)=4 each
    assert picks[0] == "cold" and "spill" in picks


def test_cold_prefixes_agree_across_gateway_replicas():
    """Two gateways with no shared state place each new prefix on the same engine."""
    now = time.monotonic()
    r1, r2 = prefix_load(), prefix_load()
    bs1, bs2 = backends(4), list(reversed(backends(4)))
    chosen = set()
    for i in range(40):
        hashes = block_hashes(f"system prompt {i} " * 10, 64, 100)
        p1, p2 = r1.pick(bs1, hashes, now), r2.pick(bs2, hashes, now)
        assert p1.backend.url == p2.backend.url and p1.decision == p2.decision == "cold"
        chosen.add(p1.backend.url)
    assert len(chosen) == 4  # and they spread over the engines


def test_cold_prefix_goes_where_the_queue_is_short_when_loads_differ():
    r, bs, now = prefix_load(cold_slack=1), backends(3), time.monotonic()
    hashes = block_hashes("a brand new prompt " * 10, 64, 100)
    first = r.pick(bs, hashes, now).backend  # even loads: the consistent-hash choice
    first.inflight = 2  # that engine is slower; the others are idle
    pick = r.pick(bs, hashes, now)
    assert pick.backend is not first and pick.backend.inflight == 0 and pick.decision == "cold"


def test_least_load_and_round_robin():
    bs, now = backends(3), time.monotonic()
    bs[0].inflight, bs[1].inflight = 2, 1
    assert make_router("least-load").pick(bs, [], now).backend is bs[2]
    rr = make_router("round-robin")
    assert [rr.pick(bs, [], now).backend for _ in range(4)] == [bs[0], bs[1], bs[2], bs[0]]
    with pytest.raises(ValueError, match="unknown routing"):
        make_router("random")


def test_load_uses_engine_queue_only_while_fresh():
    b, now = backends(1)[0], time.monotonic()
    b.inflight, b.running, b.waiting, b.last_ok = 1, 3, 2, now
    assert b.load(now) == 3 + 2 + 2
    assert b.load(now + 5) == 1  # stale data is unknown: the gateway's own count only


def test_the_engines_load_is_exported_for_the_autoscaler_while_fresh():
    """shoal:gateway_backend_* carry what the poller read from each engine, for the operator's autoscaler (engines
    it cannot scrape itself, e.g. behind a mesh): only fresh data, a missing series means unknown."""
    from prometheus_client import generate_latest

    from shoal.operator.autoscaler import gateway_view

    gw = Gateway(GatewayConfig())
    gw.backends.replace(["http://a:1", "http://b:1"])
    a, b = sorted(gw.backends.all(), key=lambda x: x.url)
    a.running, a.waiting, a.kv_usage, a.waiting_prefill_tokens, a.last_ok = 3, 1, 0.5, 120, time.monotonic()
    b.running, b.last_ok, b.inflight = 9, time.monotonic() - 60, 2  # stale: only the gateway's own count
    view = gateway_view(generate_latest(gw.metrics.registry).decode())
    assert view.engines == {"http://a:1": {"running": 3, "waiting": 1, "kv_usage": 0.5,
                                           "waiting_prefill_tokens": 120}}
    assert view.in_flight == {"http://a:1": 0, "http://b:1": 2} and view.held == 0


def test_stalled_engines_are_skipped_only_while_another_answers():
    s = BackendSet(HealthPolicy(stall_after=1.0))
    s.replace(["http://a:1", "http://b:1"])
    a, b = sorted(s.all(), key=lambda x: x.url)
    now = time.monotonic()
    a.last_answer, b.last_answer = now, now - 10
    assert s.eligible(now) == [a]
    a.last_answer = now - 10
    assert s.eligible(now) == [a, b]  # everything looks stalled: dispatch goes on
    b.ready = False
    assert s.eligible(now) == [a]


def test_parse_load_and_ready_urls():
    text = ('# HELP x\nshoal:num_requests_running{model_name="m"} 3.0\nshoal:num_requests_waiting{model_name="m"} 2\n'
            'shoal:kv_cache_usage_perc{model_name="m"} 0.5\nshoal:num_requests_running_other 9\n')
    assert parse_load(text) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.5}
    slices = {"s1": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
        {"addresses": ["fd00::3"], "conditions": {}}]}, "s2": {"ports": [], "endpoints": [{"addresses": ["x"]}]}}
    assert ready_urls(slices) == {"http://10.0.0.1:8000", "http://[fd00::3]:8000"}
    assert ready_urls(slices, port_name="metrics") == set()


@pytest.mark.parametrize("argv, message", [
    (["--allow-unauthenticated"], "or serve every InferenceService of --namespace (or --all-namespaces)"),
    (["--namespace", "ns", "--api-key", "k"], "the shared gateway takes no --api-key"),
    (["--endpoint", "http://a:1", "--tenant-keys", "/tmp"], "--tenant-keys and --engine-keys are for the shared"),
    (["-A", "--namespace", "ns"], "--all-namespaces is the shared gateway of the whole cluster"),
    (["--namespace", "ns", "--tenant-keys", "/nonexistent/dir"], "cannot read /nonexistent/dir"),
    (["--endpoint", "localhost:8000"], "not an engine base URL"),
    (["--endpoint", "http://a:1", "--service", "s"], "either as --endpoint"),
    (["--endpoint", "http://a:1", "--load-factor", "0.5"], "--load-factor must be >= 1"),
    (["--service", "s"], "--namespace"),
    (["--endpoint", "http://a:1", "--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read"),
    # unsafe combinations: an anonymous shared gateway, the engines' keys handed to anyone, a header anyone sets
    (["--namespace", "ns"], "the shared gateway must know who is asking"),
    (["--namespace", "ns", "--engine-keys", "/tmp"], "would hand them the engines' keys"),
    (["--endpoint", "http://a:1", "--tenant-header", "X-Tenant"], "--tenant-header needs --trusted-proxies"),
    (["--namespace", "ns", "--tenant-header", "X", "--trusted-proxies", "10.0.0.0/33"], "--trusted-proxies:"),
])
def test_cli_rejects_bad_arguments(argv, message):
    out = subprocess.run([sys.executable, "-m", "shoal.operator.gateway", *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


# ---- the app in-process, against a stand-in engine -----------------------------------------------------------
def stand_in_engine(delay: float = 0.0, seen: list | None = None) -> web.Application:
    """The engine's HTTP contract, reduced to what the gateway uses: /readyz, /metrics and one completion."""
    app = web.Application()
    seen = [] if seen is None else seen

    async def readyz(request):
        return web.json_response({"status": "ready"})

    async def metrics(request):
        return web.Response(text='shoal:num_requests_running{model_name="m"} 0\n')

    async def complete(request):
        seen.append({"auth": request.headers.get("Authorization"), "body": await request.json()})
        await asyncio.sleep(delay)
        return web.json_response({"choices": [{"text": "ok"}]})

    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", complete)
    return app


async def gateway_client(config: GatewayConfig, urls: list[str]) -> tuple[Gateway, TestClient]:
    gw = Gateway(config)
    gw.backends.replace(urls)
    await gw.start()
    client = TestClient(TestServer(build_app(gw)))
    await client.start_server()
    return gw, client


async def test_body_limit_pending_limit_and_unknown_routes():
    seen: list[dict] = []
    engine, url = await started(stand_in_engine(delay=0.5, seen=seen))
    gw, client = await gateway_client(GatewayConfig(max_body_bytes=1000, max_pending=1), [url])
    try:
        r = await client.post("/v1/completions", data=b"x" * 5000, headers={"Content-Type": "application/json"})
        assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"
        first = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"},
                                                headers={"Authorization": "Bearer k"}))
        while gw.pending == 0:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "b"})
        assert r.status == 429 and r.headers["Retry-After"] and (await r.json())["error"]["type"] == "rate_limit_error"
        r = await first
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
        assert seen[0]["auth"] == "Bearer k"
        r = await client.get("/nothing/here")
        assert r.status == 404 and "error" in await r.json()
    finally:
        await client.close()
        await gw.stop()
        await engine.close()


async def test_requests_are_held_until_an_engine_appears():
    gw, client = await gateway_client(GatewayConfig(hold_timeout=30), [])
    engine = TestServer(stand_in_engine())
    held_calls = []
    gw.on_hold.append(lambda: held_calls.append(1))
    try:
        assert (await client.get("/readyz")).status == 200  # ready to hold requests with no engine
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "wake up"}))
        while gw.metrics.held._value.get() == 0:
            await asyncio.sleep(0.01)
        assert held_calls == [1]
        await engine.start_server()
        gw.backends.replace([str(engine.make_url("")).rstrip("/")])  # what discovery does when a pod is Ready
        r = await pending
        assert r.status == 200
    finally:
        await client.close()
        await gw.stop()
        await engine.close()


async def test_without_the_api_key_a_request_is_refused_before_it_is_held_or_counted():
    gw, client = await gateway_client(GatewayConfig(hold_timeout=30, api_key="s3cret"), [])
    engine = TestServer(stand_in_engine())
    held_calls = []
    gw.on_hold.append(lambda: held_calls.append(1))
    try:
        wrong = ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "s3cret-not"}, {"Authorization": "s3cret"})
        for headers in wrong:
            r = await asyncio.wait_for(client.post("/v1/completions", json={"model": "m", "prompt": "x"},
                                                   headers=headers), 2)  # answered at once, not held for 30 s
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert held_calls == [] and gw.metrics.held._value.get() == 0 and gw.pending == 0
        assert gw.metrics.rejected.labels("unauthenticated")._value.get() == 4
        # the key as the engines take it: held (the autoscaler is woken), then served
        await engine.start_server()
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"},
                                                  headers={"Authorization": "Bearer s3cret"}))
        while gw.metrics.held._value.get() == 0:
            await asyncio.sleep(0.01)
        assert held_calls == [1]
        gw.backends.replace([str(engine.make_url("")).rstrip("/")])
        assert (await pending).status == 200
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={"X-API-Key": "s3cret"})
        assert r.status == 200
        assert (await client.get("/readyz")).status == 200 and (await client.get("/metrics")).status == 200
    finally:
        await client.close()
        await gw.stop()
        await engine.close()


async def test_a_draining_gateway_answers_its_held_requests_at_once():
    gw, client = await gateway_client(GatewayConfig(hold_timeout=60, retry_after=2), [])
    try:
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        while gw.metrics.held._value.get() == 0:
            await asyncio.sleep(0.01)
        gw.start_draining()  # SIGTERM: this replica restarts; its clients retry on another one
        r = await asyncio.wait_for(pending, 5)  # not after the 60 s hold
        assert r.status == 503 and r.headers["Retry-After"] == "2"
        assert (await client.get("/readyz")).status == 503
    finally:
        await client.close()
        await gw.stop()


async def test_hold_deadline_then_503():
    gw, client = await gateway_client(GatewayConfig(hold_timeout=0.3, retry_after=7), [])
    try:
        r = await client.post("/v1/completions", data=json.dumps({"model": "m", "prompt": "x"}))
        assert r.status == 503 and r.headers["Retry-After"] == "7"
        assert (await r.json())["error"]["type"] == "service_unavailable"
    finally:
        await client.close()
        await gw.stop()


async def test_request_bodies_held_at_once_are_bounded():
    seen: list[dict] = []
    engine, url = await started(stand_in_engine(delay=0.5, seen=seen))
    gw, client = await gateway_client(GatewayConfig(max_body_bytes=4000, max_buffered_bytes=6000), [url])
    try:
        body = json.dumps({"model": "m", "prompt": "x" * 3000})
        first = asyncio.create_task(client.post("/v1/completions", data=body))
        while gw.buffered == 0:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", data=body)  # 2 x 3000 bytes would exceed 6000
        assert r.status == 429 and (await r.json())["error"]["code"] == "too_much_buffered"
        assert (await client.get("/v1/models")).status != 429  # a request without a body reserves nothing
        assert (await first).status == 200 and gw.buffered == 0
        assert (await client.post("/v1/completions", data=body)).status == 200
    finally:
        await client.close()
        await gw.stop()
        await engine.close()


async def test_a_long_generation_runs_once_and_a_timeout_is_never_retried():
    """A non-streaming answer starts only when the generation ends: silence before it is not a failure. Past the
    response timeout the request is cancelled and answered 504 — never sent to a second engine."""
    seen: list[dict] = []
    engines = [TestServer(stand_in_engine(delay=1.0, seen=seen)) for _ in range(2)]
    for e in engines:
        await e.start_server()
    urls = [str(e.make_url("")).rstrip("/") for e in engines]
    gw, client = await gateway_client(GatewayConfig(read_timeout=0.2, response_timeout=5, routing="round-robin"),
                                      urls)
    try:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "long"})
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
        assert len(seen) == 1  # one run on one engine
        gw.config.response_timeout = 0.3
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "too long"})
        assert r.status == 504 and (await r.json())["error"]["code"] == "engine_timeout"
        assert len(seen) == 2  # not retried elsewhere
        retried = sum(s.value for s in gw.metrics.retries.collect()[0].samples if s.name.endswith("_total"))
        assert retried == 0
        assert all(not b.circuit_open(time.monotonic()) and b.failures == 0 for b in gw.backends.all())
    finally:
        await client.close()
        await gw.stop()
        for e in engines:
            await e.close()


def failing_engine(mode: str, hits: list) -> web.Application:
    """An engine that is up (ready, metrics) but fails every completion: "busy" answers 503 + Retry-After (a full
    queue), "reset" drops the connection before answering (a crashing or overloaded process)."""
    app = web.Application()

    async def readyz(request):
        return web.json_response({"status": "ready"})

    async def metrics(request):
        return web.Response(text='shoal:num_requests_running{model_name="m"} 0\n')

    async def complete(request):
        hits.append(1)
        if mode == "busy":
            return web.json_response({"error": {"message": "queue full"}}, status=503, headers={"Retry-After": "1"})
        request.transport.close()
        return web.Response()

    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", complete)
    return app


@pytest.mark.parametrize("mode", ["busy", "reset"])
async def test_a_failed_attempt_is_retried_on_another_engine_and_a_failing_engine_trips_its_circuit(mode):
    bad_hits: list = []
    good_seen: list = []
    bad, good = TestServer(failing_engine(mode, bad_hits)), TestServer(stand_in_engine(seen=good_seen))
    await bad.start_server()
    await good.start_server()
    # round-robin alternates the two; polls far apart, so no healthy poll forgives the failures mid-test, and a
    # cooldown no loaded machine outlasts
    config = GatewayConfig(routing="round-robin", poll_interval=60, health=HealthPolicy(circuit_cooldown=120))
    gw, client = await gateway_client(config, [str(s.make_url("")).rstrip("/") for s in (bad, good)])
    try:
        # the first poll over (its healthy answer would forgive failures it overlapped)
        deadline = time.monotonic() + 10
        while not all(b.last_ok for b in gw.backends.all()):
            assert time.monotonic() < deadline, "the gateway's first poll of both engines"
            await asyncio.sleep(0.01)
        for i in range(8):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
        assert len(good_seen) == 8  # every request was answered once, by the engine that works
        retried = sum(s.value for s in gw.metrics.retries.collect()[0].samples if s.name.endswith("_total"))
        assert retried == len(bad_hits) >= 1
        if mode == "reset":
            # three dropped connections open the engine's circuit: it gets nothing more for the cooldown
            assert len(bad_hits) == config.health.circuit_failures < 8
        else:
            assert len(bad_hits) >= 3  # a full queue is no failure of the engine: it stays in rotation
    finally:
        await client.close()
        await gw.stop()
        await bad.close()
        await good.close()


async def test_a_poll_keeps_the_readiness_answer_when_metrics_come_late_and_stays_within_its_timeout():
    async def readyz(request):
        return web.json_response({"status": "ready"})

    async def slow_metrics(request):  # a busy engine renders its metrics late
        await asyncio.sleep(5)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", slow_metrics)
    engine, backends, b = await lone_backend(app)
    try:
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            await Poller(backends, session, timeout=0.5).poll(b)
            took = time.monotonic() - t0
        assert b.ready is True and b.last_answer is not None  # it answered: not stalled, not unready
        assert b.last_ok is None  # no load data from this poll
        assert took < 0.5 + 0.4  # one timeout for the whole poll, not one per request
    finally:
        await engine.close()


# ------------------------------------------------------------------------------------------ LoRA affinity
def test_parse_lora_reads_residency_and_slots():
    from shoal.operator.gateway.poller import parse_lora

    text = ('shoal:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
            'shoal:lora_resident_info{max_cpu_lora="8",resident_lora_adapters="a,b,c"} 1.7e9\n'
            'shoal:num_requests_running{model_name="m"} 2.0\n')
    assert parse_lora(text) == {"lora_resident": frozenset("abc"), "max_cpu_loras": 8, "lora_running": 2,
                                "max_loras": 4, "served_model": "m"}
    assert parse_lora("shoal:num_requests_running 1\n")["lora_resident"] == frozenset()
    empty = 'shoal:lora_resident_info{max_cpu_lora="2",resident_lora_adapters=""} 1.0\n'
    assert parse_lora(empty)["lora_resident"] == frozenset()


def test_parse_lora_reads_vllms_names():
    """vLLM's engines export vllm:lora_requests_info (no resident-adapters gauge): the adapters a request runs or
    waits on there are resident, and its slots and base model are read by vLLM's names."""
    from shoal.operator.gateway.metric_names import VLLM
    from shoal.operator.gateway.poller import parse_lora

    text = ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters="chat"} 1.7e9\n'
            'vllm:num_requests_running{engine="0",model_name="base"} 1.0\n')
    assert parse_lora(text, VLLM) == {"lora_resident": frozenset({"sql", "chat"}), "max_cpu_loras": 0,
                                      "lora_running": 1, "max_loras": 4, "served_model": "base"}
    assert parse_lora(text)["lora_resident"] == frozenset()  # Shoal's names only: nothing resident


@pytest.mark.parametrize("routing", ["prefix-load", "least-load"])
def test_lora_affinity_prefers_resident_then_free_place_then_load(routing):
    r, bs, now = make_router(routing), backends(3), time.monotonic()
    for b in bs:
        b.max_cpu_loras, b.served_model = 2, "tiny"
    bs[0].lora_resident, bs[1].lora_resident, bs[2].lora_resident = frozenset({"x", "y"}), frozenset({"a"}), frozenset()
    bs[1].inflight = 1  # resident beats a lighter load
    assert r.pick(bs, [], now, model="a").backend is bs[1]
    # Not resident anywhere -> scored alike; resident only on bs[0], which is busy: still there.
    bs[0].inflight = 1
    assert r.pick(bs, [], now, model="x").backend is bs[0]
    # A free adapter place (bs[2]: 0 of 2 loaded) beats a full engine (bs[0]) for an adapter resident elsewhere.
    bs[1].removed = True
    assert r.pick([bs[0], bs[2]], [], now, model="a").backend is bs[2]
    # Base-model requests: load only.
    bs[2].inflight = 3
    assert r.pick([bs[0], bs[2]], [], now, model="tiny").backend is bs[0]


def test_request_model_is_read_from_the_body():
    from shoal.operator.gateway.proxy import request_model

    assert request_model("/v1/completions", b'{"model": "a", "prompt": "x"}') == "a"
    assert request_model("/v1/completions", b'{"prompt": "x"}') is None
    assert request_model("/v1/completions", b'{"model": 3}') is None
    assert request_model("/v1/models", b'{"model": "a"}') is None
    assert request_model("/v1/completions", b'not json "model"') is None


def test_a_tenant_header_is_believed_only_from_the_trusted_proxies():
    from types import SimpleNamespace

    from shoal.operator.gateway.tenants import Caller, Tenancy, parse_networks

    proxies = parse_networks("10.1.0.0/16, fd00::/8")
    shared, per_service = (Tenancy(header="X-Tenant", trusted=proxies, header_required=r) for r in (True, False))

    def request(peer: str, tenant: str | None = "team-a.batch"):
        return SimpleNamespace(remote=peer, headers={"X-Tenant": tenant} if tenant else {})

    assert shared.identify(request("10.1.2.3")) == Caller("team-a.batch", "team-a")
    assert shared.identify(request("fd00::7")) == Caller("team-a.batch", "team-a")
    for untrusted in (request("10.2.0.1"), request("10.1.2.3", None), request("garbage")):
        assert shared.identify(untrusted) is None  # 401: the shared gateway authorizes by it
    assert per_service.identify(request("10.2.0.1")) == Caller("default", None)  # ignored: the default tenant


async def test_the_per_service_gateway_keeps_engine_administration_and_priority_from_clients():
    seen: list[dict] = []
    app = stand_in_engine(seen=seen)
    loaded: list[str] = []

    async def load(request):
        loaded.append(request.path)
        return web.json_response({})

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", load)
    engine = TestServer(app)
    await engine.start_server()
    gw, client = await gateway_client(GatewayConfig(), [str(engine.make_url("")).rstrip("/")])
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await client.post(path, json={"lora_name": "x", "lora_path": "/etc"})
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        assert not loaded
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "priority": -1000})
        assert r.status == 200 and seen[-1]["body"] == {"model": "m", "prompt": "a"}
    finally:
        await client.close()
        await gw.stop()
        await engine.close()


async def test_a_client_that_disconnects_mid_answer_is_not_the_engines_failure():
    streamed = asyncio.Event()

    async def stream(request):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(500):
            await out.write(b"data: " + b"x" * 4096 + b"\n\n")
            streamed.set()
            await asyncio.sleep(0.005)
        return out

    app = stand_in_engine()
    app.router.add_post("/v1/chat/completions", stream)
    engine = TestServer(app)
    await engine.start_server()
    # Without handler cancellation the gateway keeps writing after the client is gone and the write fails: with
    # it (shoal-gateway's setting) the same happens when the write comes before the cancellation is delivered.
    gw = Gateway(GatewayConfig(health=HealthPolicy(circuit_failures=1)))
    gw.backends.replace([str(engine.make_url("")).rstrip("/")])
    await gw.start()
    runner, url = await serve(build_app(gw), handler_cancellation=False)
    server = SimpleNamespace(host="127.0.0.1", port=URL(url).port, close=runner.cleanup)
    try:
        (backend,) = gw.backends.all()
        for i in range(3):
            streamed.clear()
            reader, writer = await asyncio.open_connection(server.host, server.port)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await streamed.wait()
            writer.transport.abort()  # gone mid-answer
            deadline = time.monotonic() + 10
            while gw.metrics.requests.labels(backend.url, "client_closed")._value.get() < i + 1:
                assert time.monotonic() < deadline, "the gateway never noticed the client was gone"
                await asyncio.sleep(0.01)
            assert backend.failures == 0 and gw.metrics.requests.labels(backend.url, "broken")._value.get() == 0
        assert gw.backends.eligible() == [backend]  # no circuit opened
    finally:
        await server.close()
        await gw.stop()
        await engine.close()


async def test_the_poller_reads_each_engines_adapters_with_the_engines_key(tmp_path):
    """--api-key-file (rotation: newest key first): the poller reads /v1/models with the first line, as the engines
    require; an engine that refuses the key has an unknown list (requests are not narrowed by it)."""
    keys = tmp_path / "api-key"
    keys.write_text("new-key\nold-key\n")

    def engine(accepts: str) -> web.Application:
        app = stand_in_engine()

        async def models(request):
            if request.headers.get("Authorization") != f"Bearer {accepts}":
                return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
            return web.json_response({"object": "list", "data": [
                {"id": "m", "object": "model", "parent": None}, {"id": "sql", "object": "model", "parent": "m"}]})
        app.router.add_get("/v1/models", models)
        return app
    good, stale = TestServer(engine("new-key")), TestServer(engine("other"))
    await good.start_server()
    await stale.start_server()
    config = GatewayConfig(poll_interval=0.05, api_key=KeySet.from_file(str(keys)))
    gw, client = await gateway_client(config, [str(s.make_url("")).rstrip("/") for s in (good, stale)])
    try:
        by_url = {b.url: b for b in gw.backends.all()}
        g, s = by_url[str(good.make_url("")).rstrip("/")], by_url[str(stale.make_url("")).rstrip("/")]
        deadline = time.monotonic() + 10
        while g.adapters is None or s.ready is None:
            assert time.monotonic() < deadline, "both engines polled"
            await asyncio.sleep(0.01)
        assert g.adapters == {"sql"} and s.adapters is None
        pool = gw.pools.pool
        now = time.monotonic()
        assert pool.serving("sql", [g, s], now) == [g] and pool.serving("m", [g, s], now) == [g, s]
    finally:
        await client.close()
        await gw.stop()
        await good.close()
        await stale.close()


def test_the_per_service_gateway_takes_declared_adapters_and_served_name_from_its_inferenceservice():
    """own_service.OwnService: spec.adapters become the pool's adapters (held until an engine lists them, pool.py),
    the served name is never taken for an adapter, and a deleted or unreadable service leaves nothing declared
    behind; --inference-service belongs to a gateway of --service engines."""
    from shoal.operator.gateway.cli import build_parser, config_from_args
    from shoal.operator.gateway.own_service import OwnService

    gw = Gateway(GatewayConfig())
    pool = gw.pools.pool
    own = OwnService("llm", "team-a")
    spec = {"model": {"uri": "hf://org/base"}, "adapters": [{"name": "sql", "uri": "hf://org/sql"}, {"name": "x"}]}
    own.apply(pool, {"metadata": {"name": "llm", "namespace": "team-a"}, "spec": spec})
    now = time.monotonic()
    assert own.read and pool.adapters == {"sql", "x"} and pool.served_name == "org/base"
    assert pool.is_adapter("sql", now) and not pool.is_adapter("org/base", now) and not pool.is_adapter("other", now)
    own.apply(pool, {"metadata": {}, "spec": {}})  # unreadable (no name): what was read stays
    assert pool.adapters == {"sql", "x"}
    own.apply(pool, None)  # deleted
    assert pool.adapters == frozenset() and not pool.is_adapter("sql", now)
    for argv in (["--endpoint", "http://127.0.0.1:1", "--inference-service", "llm"],
                 ["--namespace", "ns", "--allow-unauthenticated", "--inference-service", "llm"]):
        with pytest.raises(ValueError, match="--inference-service"):
            config_from_args(build_parser().parse_args(argv))
def test_standby_endpoints_and_an_engine_the_gateway_woke():
    """Not-ready, not-terminating endpoints are standby (parked asleep, or loading); one the gateway woke is a
    backend at once and stays one until its endpoint turns Ready or goes away."""
    slices = {"s": {"ports": [{"port": 8000}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "terminating": True}}]}}
    assert ready_urls(slices, standby=True) == {"http://10.0.0.2:8000"}
    backends = BackendSet()
    backends.replace(set(), {"http://10.0.0.2:8000"})
    assert not backends.eligible() and backends.standby == {"http://10.0.0.2:8000"}
    backends.add_woken("http://10.0.0.2:8000")
    assert [b.url for b in backends.eligible()] == ["http://10.0.0.2:8000"]
    backends.replace(set(), {"http://10.0.0.2:8000"})  # another slice event: still not Ready, still ours
    assert [b.url for b in backends.eligible()] == ["http://10.0.0.2:8000"]
    backends.replace({"http://10.0.0.2:8000"}, set())  # Ready now: discovery's own
    assert not backends.woken and [b.url for b in backends.eligible()] == ["http://10.0.0.2:8000"]
    backends.add_woken("http://10.0.0.9:8000")
    backends.replace(set(), set())  # the pod went away
    assert not backends.eligible() and not backends.woken


async def test_a_held_request_wakes_a_parked_engine_and_goes_to_it():
    """The gateway's EngineWaker: POST /wake_up with the engines' key to a standby endpoint, then the request held
    for lack of a Ready engine is forwarded to it; an engine still loading (503) is skipped."""
    calls = []
    LOADING, ASLEEP = web.AppKey("loading", bool), web.AppKey("asleep", bool)

    async def wake_up(request):
        calls.append(request.headers.get("Authorization"))
        if request.app[LOADING]:
            return web.json_response({"error": {"message": "loading"}}, status=503)
        request.app[ASLEEP] = False
        return web.json_response({"is_sleeping": False})

    async def completions(request):
        if request.app[ASLEEP]:
            return web.json_response({"error": {"code": "sleeping"}}, status=503)
        return web.json_response({"choices": [{"text": "awake"}]})

    async def readyz(request):
        return web.json_response({}, status=503 if request.app[ASLEEP] else 200)

    async def metrics(request):
        return web.Response(text="")

    servers = []
    for loading in (True, False):
        app = web.Application()
        app[LOADING], app[ASLEEP] = loading, True
        app.router.add_post("/wake_up", wake_up)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
    urls = sorted(str(s.make_url("")).rstrip("/") for s in servers)
    gw, client = await gateway_client(GatewayConfig(hold_timeout=30, wake_engines=True, api_key="k"), [])
    gw.backends.replace(set(), set(urls))  # both parked or loading: not Ready, not terminating
    try:
        r = await asyncio.wait_for(client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                                               headers={"Authorization": "Bearer k"}), 20)
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "awake"
        assert calls and all(key == "Bearer k" for key in calls), calls
        assert [b.url for b in gw.backends.eligible()] == [str(servers[1].make_url("")).rstrip("/")]
        # the admin routes are never forwarded from a client
        for path in ("/wake_up", "/sleep", "/is_sleeping"):
            r = await client.post(path, headers={"Authorization": "Bearer k"})
            assert r.status == 404, path
    finally:
        await client.close()
        await gw.stop()
        for s in servers:
            await s.close()
