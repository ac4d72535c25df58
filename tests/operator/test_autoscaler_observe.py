"""The autoscaler's observing parts without a cluster: the fleet-wide bound on scrapes, the gateways' view of the
engines, which operator replica leads (kopf's peering rule), and the namespaces it watches."""

from __future__ import annotations

import asyncio
import datetime
import time

import aiohttp
import pytest
from aiohttp import web
from webkit import serve

from shoal.operator import autoscaler
from shoal.operator.__main__ import parse, watched_namespaces
from shoal.operator.autoscaler import Autoscaler, gateway_view, load_from_gateways
from shoal.operator.leadership import Leadership


async def test_scrapes_are_bounded_across_the_fleet():
    """However many engines every service has, at most max_concurrent_scrapes /metrics requests are in flight; the
    timeout counts from when a scrape may start, so waiting for a slot is not a failure."""
    busy, most = 0, 0

    async def metrics(_request):
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        await asyncio.sleep(0.05)
        busy -= 1
        return web.Response(text="shoal:num_requests_running 1\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await serve(app)
    scaler = Autoscaler(kube=None, max_concurrent_scrapes=4)
    scaler.session = aiohttp.ClientSession()
    try:
        texts = await asyncio.gather(*(scaler._scrape(url, "engine") for _ in range(60)))
    finally:
        await scaler.session.close()
        await runner.cleanup()
    assert all(t is not None for t in texts)  # 60 × 50 ms through 4 slots: 0.75 s, each within its own timeout
    assert most == 4


async def test_a_failing_engine_is_retried_with_backoff_only_when_the_gateways_cover_it():
    scaler = Autoscaler(kube=None)
    scaler.session = aiohttp.ClientSession()
    dead = "http://127.0.0.1:9"  # discard port: refused
    try:
        for _ in range(3):
            assert await scaler._scrape_engine(dead, may_skip=True) is None
        failures, next_try = scaler.failing[dead]
        assert failures == 2  # the third was skipped: in backoff
        assert next_try > time.monotonic()
        assert await scaler._scrape_engine(dead, may_skip=False) is None  # loadSource engines: always tried
        assert scaler.failing[dead][0] == 3
    finally:
        await scaler.session.close()


def test_gateway_view_and_the_engine_load_it_gives():
    a, b, c = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
    text = (f'shoal:gateway_held_requests 3\n'
            f'shoal:gateway_inflight_requests{{backend="{a}"}} 2\n'
            f'shoal:gateway_inflight_requests{{backend="{b}"}} 5\n'
            f'shoal:gateway_backend_running_requests{{backend="{a}"}} 7\n'
            f'shoal:gateway_backend_waiting_requests{{backend="{a}"}} 1\n'
            f'shoal:gateway_backend_kv_cache_usage{{backend="{a}"}} 0.25\n'
            f'shoal:gateway_backend_waiting_prefill_tokens{{backend="{a}"}} 300\n')
    view = gateway_view(text)
    assert view.held == 3 and view.in_flight == {a: 2, b: 5} and view.batch_pending == 0
    batches = gateway_view('shoal:gateway_batch_pending_requests{model="llm"} 7\n'
                           'shoal:gateway_batch_pending_requests{model="llm-lora"} 2\n')
    assert batches.batch_pending == 9 and batches.held == 0
    other = gateway_view(f'shoal:gateway_inflight_requests{{backend="{b}"}} 4\n'
                         f'shoal:gateway_backend_running_requests{{backend="{a}"}} 9\n')
    # polled gauges: the engine's own (the highest report); else the gateways' in-flight counts, summed
    assert load_from_gateways(a, [view, other]) == {"running": 9, "waiting": 1, "kv_usage": 0.25,
                                                    "waiting_prefill_tokens": 300}
    assert load_from_gateways(b, [view, other])["running"] == 9
    assert load_from_gateways(c, [view, other])["running"] == 0  # no traffic through any gateway: idle, known
    assert load_from_gateways(a, []) is None  # no gateway answered: unknown


def _peering(*entries, name="shoal", now=None):
    now = now or datetime.datetime.now(datetime.timezone.utc)
    status = {f"peer-{i}": {"priority": prio, "lifetime": 10,
                            "lastseen": (now - datetime.timedelta(seconds=age)).isoformat()}
              for i, (prio, age) in enumerate(entries)}
    return {"metadata": {"name": name}, "status": status}


def test_leadership_follows_kopfs_peering_rule():
    me = Leadership(standalone=False, peering_name="shoal", priority=200)
    assert Leadership().leading([])  # standalone
    assert not me.leading([])  # --peering NAME: no peering object, kopf stays paused
    assert Leadership(standalone=False, peering_name="shoal", priority=5, mandatory=False).leading([])
    assert me.leading([_peering((200, 1), (100, 1))])  # the highest live priority
    assert not me.leading([_peering((200, 1), (300, 1))])  # a higher one lives
    assert me.leading([_peering((200, 1), (300, 30))])  # ... and died (not seen for longer than its lifetime)
    assert not me.leading([_peering((200, 1), (200, 1))])  # a twin: kopf pauses both
    assert not me.leading([_peering((200, 30), (100, 1))])  # our own keep-alive expired: cut off, step down
    assert me.leading([_peering((200, 1)), _peering((900, 1), name="another-operator")])
    assert not me.leading([{"metadata": {"name": "shoal"}, "status": {"peer-0": None}}])


@pytest.mark.parametrize("argv,expected", [
    (["--standalone", "-A"], ""),
    (["-n", "team-a", "--namespace", "team-b", "--namespace=team-a"], "team-a,team-b"),
    (["-nteam-a"], "team-a"),
    (["-n", "team-*"], ""),  # a pattern: only a cluster-wide watch follows it
])
def test_the_autoscaler_watches_the_operators_namespaces(argv, expected):
    assert watched_namespaces(argv) == expected


def test_new_flags():
    env, rest = parse(["--max-concurrent-scrapes", "8", "--peering-lifetime", "5", "-A", "--peering=shoal"])
    assert env["SHOAL_MAX_CONCURRENT_SCRAPES"] == "8" and env["SHOAL_PEERING_LIFETIME"] == "5"
    assert rest == ["-A", "--peering=shoal"]  # kopf's --peering is no abbreviation of --peering-lifetime
    with pytest.raises(SystemExit, match="max-concurrent-scrapes"):
        parse(["--max-concurrent-scrapes", "0"])
    assert autoscaler.MAX_CONCURRENT_SCRAPES >= 1


async def test_which_engines_sleep_is_read_from_the_engines_not_from_memory():
    """scaleToZero sleep: a fresh autoscaler (an operator restart, a new leader) learns which replicas are parked
    from each engine's /is_sleeping, marks the pods, and counts only the awake ones as replicas; an engine that
    does not answer (still loading) is awake, and a terminating endpoint is not a parked replica."""
    levels = {"a": 2, "b": 0, "c": None}

    async def is_sleeping(request):
        level = levels[request.match_info["pod"]]
        if level is None:
            return web.json_response({"error": {"message": "loading"}}, status=503)
        return web.json_response({"is_sleeping": bool(level), "level": level or None})

    app = web.Application()
    app.router.add_get("/{pod}/is_sleeping", is_sleeping)
    runner, base = await serve(app)
    patches = []

    class Kube:
        async def merge_patch(self, kind, ns, name, body, **_):
            patches.append((kind, name, body["metadata"]["annotations"][autoscaler.A_SLEEPING]))

    scaler = Autoscaler(kube=Kube())
    scaler.session = aiohttp.ClientSession()
    state = autoscaler.State()
    engines = [autoscaler.Endpoint(f"{base}/{p}", p, ready=p == "b") for p in "abc"]
    engines.append(autoscaler.Endpoint(f"{base}/a", "old", ready=False, terminating=True))
    try:
        assert await scaler._observe_sleep("ns", engines, state) == ("a",)
        assert sorted(patches) == [("Pod", "a", "2"), ("Pod", "b", None)]  # "c" did not say: left alone
        patches.clear()
        assert await scaler._observe_sleep("ns", engines, state) == ("a",)
        assert patches == []  # annotations are patched only when they change
        levels["a"] = 0  # a gateway woke it
        assert await scaler._observe_sleep("ns", engines, state) == ()
        assert patches == [("Pod", "a", None)]
    finally:
        await scaler.session.close()
        await runner.cleanup()
