"""Admission by priority and fairly across tenants (operator/gateway/admission.py, pool.py), and the shared gateway's
routing by model (fleet.py), in-process against stand-in engines whose answers the tests release one by one: the
order in which requests reach an engine is the assertion, so no timing bound is involved."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from webkit import configmap_api

from shoal.operator.gateway.admission import FairQueue, Ticket, request_cost
from shoal.operator.k8s.client import KubeAPI
from shoal.operator.gateway.fleet import ServiceView
from shoal.operator.gateway.proxy import Gateway, GatewayConfig, build_app
from shoal.operator.gateway.tenants import EngineKeys, TenantKeys


# ---- the queue alone --------------------------------------------------------------------------------------------
def test_a_higher_priority_always_goes_first_and_a_late_tenant_is_not_behind_a_flood():
    q = FairQueue()
    flood = [Ticket(tenant="a", cost=100) for _ in range(6)]
    for t in flood:
        q.push(t)
    trickle = Ticket(tenant="b", cost=100)
    q.push(trickle)
    urgent = Ticket(tenant="c", cost=5000, priority=5)
    q.push(urgent)
    order = [q.pop() for _ in range(len(q))]
    assert order[0] is urgent  # strict priority, whatever its cost
    assert order[1] is flood[0] and order[2] is trickle  # b's first request starts where a's first did
    assert order[3:] == flood[1:]
    # b comes back after a's flood moved the virtual time on: it is next again, and gets no credit for idling
    for t in flood:
        t.queued = False
        q.push(t)
    q.pop()
    late = Ticket(tenant="b", cost=100)
    q.push(late)
    assert q.pop() is late
    assert q.pop() is flood[1]


def test_costs_share_by_work_not_by_request_count():
    q = FairQueue()
    longs = [Ticket(tenant="long", cost=1000) for _ in range(3)]
    shorts = [Ticket(tenant="short", cost=100) for _ in range(30)]
    for t in longs + shorts:
        q.push(t)
    first = [q.pop() for _ in range(13)]
    # in the work of two long requests, twenty short ones: each tenant gets about the same tokens
    assert sum(t in longs for t in first) == 2 and sum(t in shorts for t in first) == 11


def test_shedding_takes_the_newest_of_the_lowest_priority_below_and_a_removed_request_gives_back_its_tags():
    q = FairQueue()
    low_old, low_new, mid = Ticket(priority=-1), Ticket(priority=-1), Ticket(priority=0)
    for t in (low_old, low_new, mid):
        q.push(t)
    assert q.victim(below=10) is low_new and q.victim(below=-1) is None and q.victim(below=0) is low_new
    q.remove(low_new)
    q.remove(low_old)
    assert q.victim(below=10) is mid and len(q) == 1 and q.by_priority() == {0: 1}
    # a tenant whose waiting request was removed (shed, timed out, client gone) keeps no debt for it
    a = Ticket(tenant="a", cost=500, priority=0)
    q.push(a)
    q.remove(a)
    b = Ticket(tenant="a", cost=1)
    q.push(b)
    assert b.start == a.start


def test_request_cost_counts_prompt_and_answer():
    assert request_cost(400, {"max_tokens": 16}) == 1 + 100 + 16
    assert request_cost(400, {"max_completion_tokens": 8}) == 1 + 100 + 8
    assert request_cost(0, {}) == 1 + 256  # no max_tokens: a typical answer, not the context's end
    assert request_cost(0, {"max_tokens": True}) == 1 + 256


# ---- stand-in engines -------------------------------------------------------------------------------------------
class Engine:
    """An engine whose completions wait until the test releases them; it records what it got, in order."""

    def __init__(self, name: str, served: str = "m", adapters: tuple[str, ...] = (), hold: bool = True):
        self.name, self.served, self.adapters, self.hold = name, served, adapters, hold
        self.seen: list[dict] = []
        self.gates: list[asyncio.Event] = []
        app = web.Application()
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/embeddings", self.complete)
        self.server = TestServer(app)

    async def readyz(self, request):
        return web.json_response({"status": "ready"})

    async def metrics(self, request):
        return web.Response(text=f'shoal:num_requests_running{{model_name="{self.served}"}} 0\n')

    async def models(self, request):
        cards = [{"id": self.served, "object": "model", "parent": None, "owned_by": "shoal"}]
        cards += [{"id": a, "object": "model", "parent": self.served, "owned_by": "shoal"} for a in self.adapters]
        return web.json_response({"object": "list", "data": cards})

    async def complete(self, request):
        body = await request.json()
        gate = asyncio.Event()
        self.seen.append({"body": body, "auth": request.headers.get("Authorization"),
                          "tenant": request.headers.get("X-Tenant")})
        self.gates.append(gate)
        if self.hold:
            await gate.wait()
        return web.json_response({"engine": self.name, "model": body.get("model")})

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def __aenter__(self):
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc):
        for g in self.gates:
            g.set()
        await self.server.close()

    def release(self, i: int) -> None:
        self.gates[i].set()


async def until(predicate, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def started(gateway: Gateway) -> TestClient:
    await gateway.start()
    # as shoal-gateway runs it: a client that disconnects cancels its handler
    client = TestClient(TestServer(build_app(gateway), handler_cancellation=True))
    await client.start_server()
    return client


def post(client: TestClient, model: str, tenant: str | None = None, **body) -> asyncio.Task:
    headers = {"X-Tenant": tenant} if tenant else {}
    return asyncio.create_task(client.post("/v1/completions", json={"model": model, "prompt": "p", **body},
                                           headers=headers))


async def test_a_flooding_tenant_waits_its_turn_and_another_tenant_goes_next():
    async with Engine("e") as engine:
        gw = Gateway(GatewayConfig(max_inflight=1, tenant_header="X-Tenant", poll_interval=0.05))
        gw.backends.replace([engine.url])
        client = await started(gw)
        try:
            flood = [post(client, "m", "a", max_tokens=64) for _ in range(4)]
            await until(lambda: len(engine.seen) == 1 and len(gw.pools.pool.queue) == 3)
            trickle = post(client, "m", "b", max_tokens=64)
            await until(lambda: len(gw.pools.pool.queue) == 4)
            for i in range(5):
                engine.release(i)
                await until(lambda: len(engine.seen) == min(i + 2, 5))
            assert [s["tenant"] for s in engine.seen] == ["a", "b", "a", "a", "a"]  # b did not wait for the flood
            assert [(await t).status for t in [*flood, trickle]] == [200] * 5
            wait = gw.metrics.queue_wait.labels("0")
            assert wait._sum.get() > 0 and gw.pools.pool.backends.all()[0].inflight == 0
        finally:
            await client.close()
            await gw.stop()


async def test_a_request_that_waits_too_long_for_a_slot_gets_429_and_a_gone_client_frees_its_place():
    async with Engine("e") as engine:
        gw = Gateway(GatewayConfig(max_inflight=1, queue_timeout=0.3, retry_after=3))
        gw.backends.replace([engine.url])
        client = await started(gw)
        try:
            first = post(client, "m")
            await until(lambda: len(engine.seen) == 1)
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "late"})
            assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert (await r.json())["error"]["code"] == "queue_timeout"
            gone = post(client, "m")
            await until(lambda: len(gw.pools.pool.queue) == 1)
            gone.cancel()  # the client disconnects while it waits
            await until(lambda: len(gw.pools.pool.queue) == 0)
            engine.release(0)
            assert (await first).status == 200
            nxt = post(client, "m")
            await until(lambda: len(engine.seen) == 2)  # the slot is free again: at once
            engine.release(1)
            assert (await nxt).status == 200
        finally:
            await client.close()
            await gw.stop()


# ---- the shared gateway, in-process -------------------------------------------------------------------------------
def isvc(name: str, served: str, *, priority: int = 0, max_num_seqs: int | None = None, adapters=(),
         from_zero: bool = False, scheduling: str | None = None, namespace: str = "team") -> dict:
    engine = {k: v for k, v in (("maxNumSeqs", max_num_seqs), ("schedulingPolicy", scheduling)) if v}
    spec = {"model": {"uri": f"hf://org/{name}", "servedName": served}, "priority": priority, "engine": engine,
            "probes": {"startupTimeoutSeconds": 30}}
    if adapters:  # names, or (name, priority)
        spec["adapters"] = [{"name": a, "uri": f"hf://org/{a}"} if isinstance(a, str)
                            else {"name": a[0], "uri": f"hf://org/{a[0]}", "priority": a[1]} for a in adapters]
    if from_zero:
        spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    return {"metadata": {"namespace": namespace, "name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": spec}


def endpoint_slice(service: str, url: str, namespace: str = "team", ready: bool = True) -> dict:
    host, port = url.rsplit(":", 1)
    return {"metadata": {"namespace": namespace, "name": f"{service}-x",
                         "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
            "endpoints": [{"addresses": [host.split("//")[1]], "conditions": {"ready": ready}}]}


async def shared(config: GatewayConfig, services: list[dict], engines: dict[str, Engine],
                 api: KubeAPI | None = None) -> tuple[Gateway, TestClient]:
    """A shared gateway fed the InferenceServices and EndpointSlices its watches would list."""
    gw = Gateway(config, namespace="team", shared=True, kube_api=api)
    gw.pools.watch = _no_watch  # the tests play the API server's part
    client = await started(gw)
    gw.pools.reset(services)
    gw.pools.slices_reset([endpoint_slice(f"{name}-engines", e.url) for name, e in engines.items()])
    await until(lambda: all(p.backends.eligible() for p in gw.pools.all() if p.name in engines))
    return gw, client


async def _no_watch():
    return []


async def test_the_shared_gateway_routes_by_model_lists_every_model_and_hides_what_it_does_not_serve():
    # the engines list the adapter the spec declares (loaded by the sidecar) and one loaded at run time
    async with Engine("chat", served="chat-7b", adapters=("sql-lora", "support-lora"), hold=False) as chat, \
            Engine("code", served="coder", hold=False) as code:
        gw, client = await shared(GatewayConfig(models_interval=0.1), [
            isvc("chat", "chat-7b", adapters=("support-lora",)), isvc("code", "coder")],
            {"chat": chat, "code": code})
        try:
            for model, engine in (("chat-7b", "chat"), ("coder", "code"), ("support-lora", "chat")):
                r = await client.post("/v1/completions", json={"model": model, "prompt": "x"})
                assert r.status == 200 and (await r.json()) == {"engine": engine, "model": model}
            # an adapter the engines list (loaded at run time) routes to its base model's service
            await until(lambda: gw.pools.resolve("sql-lora") is not None)
            r = await client.post("/v1/completions", json={"model": "sql-lora", "prompt": "x"})
            assert (await r.json())["engine"] == "chat"
            models = await (await client.get("/v1/models")).json()
            by_id = {c["id"]: c for c in models["data"]}
            assert set(by_id) == {"chat-7b", "sql-lora", "support-lora", "coder"}
            assert by_id["sql-lora"]["parent"] == by_id["support-lora"]["parent"] == "chat-7b"
            assert (await (await client.get("/v1/models/coder")).json())["id"] == "coder"
            r = await client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
            error = (await r.json())["error"]
            assert r.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
            assert "chat-7b" not in error["message"] and "coder" not in error["message"]  # lists nothing
            assert (await client.get("/v1/models/gpt-5")).status == 404
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status == 400 and (await r.json())["error"]["code"] == "model_required"
            # engine administration is not reachable through the platform's entry point
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
            assert r.status == 404
            assert (await client.get("/version")).status == 200
            # an engine that refuses connections: retried on the service's other engine, and marked not ready
            from prockit import free_port

            gw.pools.slice_event("ADDED", endpoint_slice("code-engines", f"http://127.0.0.1:{free_port()}"))
            slices = gw.pools.slices[("team", "code-engines")]
            slices["code-engines-y"] = {**endpoint_slice("code-engines", code.url),
                                        "metadata": {"namespace": "team", "name": "code-engines-y",
                                                     "labels": {"kubernetes.io/service-name": "code-engines"}}}
            gw.pools.slice_event("ADDED", slices["code-engines-y"])
            await until(lambda: len(gw.pools.resolve("coder").backends.all()) == 2)
            (live,) = [b for b in gw.pools.resolve("coder").backends.all() if b.url == code.url]
            live.inflight += 5  # busy: the router tries the other one first
            r = await client.post("/v1/completions", json={"model": "coder", "prompt": "x"})
            live.inflight -= 5
            assert r.status == 200 and (await r.json())["engine"] == "code"
            assert gw.metrics.retries.labels("refused")._value.get() == 1
            # a deleted service's models are gone
            gw.pools.isvc_event("DELETED", isvc("code", "coder"))
            r = await client.post("/v1/completions", json={"model": "coder", "prompt": "x"})
            assert r.status == 404
        finally:
            await client.close()
            await gw.stop()


async def test_tenant_keys_authenticate_and_the_engines_get_their_own_key(tmp_path):
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "team.a").write_text("sk-a1\nsk-a2\n")  # a tenant of namespace team
    (tmp_path / "tenants" / "team-b").write_text("sk-b\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "team.chat").write_text("engine-secret\n")
    async with Engine("chat", served="chat-7b", hold=False) as chat:
        config = GatewayConfig(tenant_keys=TenantKeys(str(tmp_path / "tenants")),
                               engine_keys=EngineKeys(str(tmp_path / "engines")))
        gw, client = await shared(config, [isvc("chat", "chat-7b", scheduling="priority", priority=3)],
                                  {"chat": chat})
        try:
            for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "Bearer engine-secret"}):
                r = await client.post("/v1/completions", json={"model": "chat-7b", "prompt": "x"}, headers=headers)
                assert r.status == 401
                assert (await client.get("/v1/models", headers=headers)).status == 401  # not even the list
            r = await client.post("/v1/completions", json={"model": "chat-7b", "prompt": "x", "priority": -100},
                                  headers={"X-API-Key": "sk-a2"})
            assert r.status == 200
            assert chat.seen[-1]["auth"] == "Bearer engine-secret"  # never the tenant's key
            # the engines schedule by priority: the service's, in vLLM's sense (lower first), not the client's
            assert chat.seen[-1]["body"]["priority"] == -3 * 2**20
            assert config.tenant_keys.tenant_of("sk-b") == "team-b"
        finally:
            await client.close()
            await gw.stop()


async def test_an_adapter_with_a_priority_of_its_own_is_ranked_by_it_and_the_others_by_the_service():
    async with Engine("chat", served="chat-7b", adapters=("sql-lora", "plain-lora"), hold=False) as chat:
        gw, client = await shared(GatewayConfig(), [
            isvc("chat", "chat-7b", scheduling="priority", priority=3, adapters=[("sql-lora", 9), "plain-lora"])],
            {"chat": chat})
        try:
            ranks = {}
            for model in ("chat-7b", "sql-lora", "plain-lora"):
                r = await client.post("/v1/completions", json={"model": model, "prompt": "x"})
                assert r.status == 200
                ranks[model] = chat.seen[-1]["body"]["priority"]
            assert ranks == {"chat-7b": -3 * 2**20, "sql-lora": -9 * 2**20, "plain-lora": -3 * 2**20}
            pool = gw.pools.resolve("sql-lora")
            assert pool.priority_of("sql-lora") == 9 and pool.priority_of("chat-7b") == 3
        finally:
            await client.close()
            await gw.stop()


async def test_a_declared_adapter_no_engine_lists_yet_waits_for_one_and_blocks_nobody():
    async with Engine("chat", served="chat-7b", hold=False) as chat:
        gw, client = await shared(GatewayConfig(), [isvc("chat", "chat-7b", adapters=("new-lora", "bad-lora"))],
                                  {"chat": chat})
        pool = gw.pools.resolve("chat-7b")
        try:
            await until(lambda: pool.backends.all()[0].adapters is not None)  # its list read (until then: unknown)
            waiting = post(client, "new-lora")  # in spec.adapters, not loaded yet: held, not sent to a 404
            await until(lambda: pool.adapter_waits == 1)
            assert "shoal:gateway_adapter_wait_requests 1.0" in generate_latest(gw.metrics.registry).decode()
            r = await client.post("/v1/completions", json={"model": "chat-7b", "prompt": "x"})
            assert r.status == 200 and len(chat.seen) == 1  # the base model goes at once, the adapter waits
            chat.adapters = ("new-lora",)  # the sidecar loaded it: the next poll lists it
            r = await waiting
            assert r.status == 200 and (await r.json()) == {"engine": "chat", "model": "new-lora"}
            assert pool.adapter_waits == 0
            pool.queue_timeout = 0.3  # an adapter that never loads: a bounded wait, then 503 naming it
            r = await client.post("/v1/completions", json={"model": "bad-lora", "prompt": "x"})
            assert r.status == 503 and r.headers["Retry-After"]
            error = (await r.json())["error"]
            assert error["code"] == "adapter_not_loaded" and "`bad-lora`" in error["message"]
            assert [s["body"]["model"] for s in chat.seen] == ["chat-7b", "new-lora"]
        finally:
            await client.close()
            await gw.stop()


async def test_under_saturation_the_lowest_priority_is_shed_first():
    async with Engine("low") as low, Engine("high") as high:
        gw, client = await shared(GatewayConfig(max_queued=2, retry_after=5), [
            isvc("low", "batch", priority=-1, max_num_seqs=1), isvc("high", "chat", priority=10, max_num_seqs=1)],
            {"low": low, "high": high})
        try:
            lows = [post(client, "batch") for _ in range(3)]  # one runs, two wait: the waiting room is full
            await until(lambda: len(low.seen) == 1 and sum(len(p.queue) for p in gw.pools.all()) == 2)
            highs = [post(client, "chat") for _ in range(2)]  # one runs; the other takes the newest low's place
            shed = await lows[2]
            assert shed.status == 429 and shed.headers["Retry-After"] == "5"
            assert (await shed.json())["error"]["code"] == "shed"
            await until(lambda: len(high.seen) == 1 and len(gw.pools.resolve("chat").queue) == 1)
            # nothing below a low-priority newcomer: it is refused itself
            r = await client.post("/v1/completions", json={"model": "batch", "prompt": "x"})
            assert r.status == 429 and (await r.json())["error"]["code"] == "queue_full"
            high.release(0)
            low.release(0)
            await until(lambda: len(high.seen) == 2 and len(low.seen) == 2)
            high.release(1)
            low.release(1)
            assert [(await t).status for t in (lows[0], lows[1], *highs)] == [200] * 4
            assert gw.metrics.rejected.labels("shed")._value.get() == 1
        finally:
            await client.close()
            await gw.stop()


async def _fake_api() -> tuple[web.AppRunner, str, list[str]]:
    patched: list[str] = []

    async def record(request: web.Request) -> None:
        patched.append(f"{request.match_info['ns']}/{request.match_info['name']}")

    runner, url = await configmap_api(record)
    return runner, url, patched


async def test_a_model_at_zero_is_held_and_only_its_service_is_woken():
    runner, url, patched = await _fake_api()
    async with Engine("chat", served="chat-7b", hold=False) as chat:
        gw, client = await shared(GatewayConfig(), [isvc("chat", "chat-7b", from_zero=True),
                                                    isvc("code", "coder", from_zero=True)], {},
                                  api=KubeAPI(url))
        try:
            pending = post(client, "chat-7b")
            await until(lambda: gw.pools.resolve("chat-7b").held == 1 and patched)
            assert patched == ["team/chat-wake"]  # the requested model's service, and no other
            assert gw.metrics.held._value.get() == 1
            gw.pools.slice_event("ADDED", endpoint_slice("chat-engines", chat.url))  # its first replica is Ready
            r = await asyncio.wait_for(pending, 10)
            assert r.status == 200 and (await r.json())["engine"] == "chat"
            assert ServiceView.of(isvc("code", "coder", from_zero=True)).hold_timeout == 30
        finally:
            await client.close()
            await gw.stop()
            await runner.cleanup()


def test_the_gateway_reads_the_served_name_as_the_operator_derives_it():
    from shoal.operator import api

    for spec in ({"model": {"uri": "hf://Qwen/Qwen2.5-7B"}}, {"model": {"uri": "demo://"}},
                 {"model": {"uri": "hf://a/b", "servedName": "chat"}}, {}):
        parsed = api.parse_spec(spec)
        view = ServiceView.of({"metadata": {"name": "svc", "namespace": "ns"}, "spec": spec})
        assert view.served_name == api.served_model_name("svc", parsed)
    assert ServiceView.of({"metadata": {"name": "s"}, "spec": {"gateway": {"enabled": False}}}).engine_service == "s"


def test_the_shared_gateway_wakes_parked_engines_of_services_that_sleep_at_zero():
    def view(autoscaling):
        return ServiceView.of({"metadata": {"name": "s", "namespace": "ns"}, "spec": {"autoscaling": autoscaling}})

    assert view({"minReplicas": 0, "maxReplicas": 2, "scaleToZero": "sleep"}).wake_engines
    assert not view({"minReplicas": 0, "maxReplicas": 2}).wake_engines  # delete: nothing parked to wake
    assert not view({"minReplicas": 1, "maxReplicas": 2, "scaleToZero": "sleep"}).wake_engines


def test_tenant_keys_follow_their_secret_without_a_restart(tmp_path):
    (tmp_path / "team-a").write_text("sk-1\n")
    keys = TenantKeys(str(tmp_path), reload_interval=0)
    assert keys.tenant_of("sk-1") == "team-a" and keys.tenant_of("sk-2") is None
    (tmp_path / "team-a").write_text("sk-2\n")  # rotated
    (tmp_path / "team-b").write_text("sk-b\n")  # a new tenant
    assert keys.tenant_of("sk-1") is None and keys.tenant_of("sk-2") == "team-a" and keys.tenant_of("sk-b") == "team-b"
    (tmp_path / "team-b").unlink()
    assert keys.tenant_of("sk-b") is None


@pytest.mark.parametrize("line", ["", "x"])
def test_tenant_keys_need_at_least_one_key(tmp_path, line):
    (tmp_path / "team").write_text(line)
    if line:
        assert TenantKeys(str(tmp_path)).tenants == ["team"]
    else:
        with pytest.raises(ValueError, match="holds no tenant keys"):
            TenantKeys(str(tmp_path))


def test_engine_priority_ranks_the_model_then_the_tenants_excess_over_its_fair_share_of_the_engine():
    gw = Gateway(GatewayConfig())
    pool, ticket = gw.pools.pool, Ticket(priority=2)
    body = json.dumps({"model": "m", "priority": 9}).encode()
    # fcfs engines get the client's body, less a priority of its own (one it could promote itself with)
    assert json.loads(gw.engine_body(pool, ticket, body, json.loads(body))) == {"model": "m"}
    plain = json.dumps({"model": "m"}).encode()
    assert gw.engine_body(pool, ticket, plain, json.loads(plain)) is plain
    pool.engine_priority = True

    def rank(t: Ticket) -> int:
        return json.loads(gw.engine_body(pool, t, body, json.loads(body)))["priority"]

    gw.backends.replace(["http://e:1"])
    flood = [Ticket(tenant="a") for _ in range(3)]
    engines = [pool.pick(t) for t in flood]
    trickle = Ticket(tenant="b")
    pool.pick(trickle)
    # a alone is always at its share (first come, first served); b arrives below its share: before all of a's
    assert [rank(t) for t in flood] == [0, 0, 0] and rank(trickle) == -3
    second = Ticket(tenant="b")
    pool.pick(second)
    assert rank(second) == 1 * 2 - 4  # still below its share while a holds three of five
    third_a = Ticket(tenant="a")
    pool.pick(third_a)
    assert third_a.share == 3 * 2 - 5 and rank(third_a) == 0  # above its share: arrival order, never pushed back
    assert rank(Ticket(priority=2)) == -2 * 2**20 < rank(Ticket(priority=0, share=-5))  # the model's priority first
    for t, e in zip(flood, engines):
        pool.release(e, t)
    assert engines[0].tenants == {"a": 1, "b": 2} and engines[0].inflight == 3
