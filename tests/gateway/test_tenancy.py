"""Tenancy at the shared gateway, in-process against stand-in engines (the real-process version is
tests/operator/test_shared_gateway_e2e.py): names belong to their namespace, a tenant uses its own namespace's
models and those of namespaces that grant it, on every route, and what it may not use looks unknown."""

from __future__ import annotations

import asyncio

from aiohttp import web
from webkit import serve

from shoal.operator.gateway.fleet import GRANT_ANNOTATION
from shoal.operator.gateway.proxy import GatewayConfig
from shoal.operator.gateway.tenants import TenantKeys

from .test_admission import Engine, endpoint_slice, isvc, shared, until


class LoraEngine(Engine):
    """Lists its adapters the way vLLM does: `root` is the adapter's path on the engine's disk."""

    async def models(self, request):
        cards = [{"id": self.served, "object": "model", "parent": None, "root": "/models/base", "owned_by": "vllm"}]
        cards += [{"id": a, "object": "model", "parent": self.served, "root": f"/adapters/{a}", "owned_by": "vllm"}
                  for a in self.adapters]
        return web.json_response({"object": "list", "data": cards})


def service(namespace: str, name: str, served: str, *, grants: str | None = None, adapters=(),
            created: str = "2026-01-01T00:00:00Z") -> dict:
    obj = isvc(name, served, namespace=namespace, adapters=adapters)
    obj["metadata"]["creationTimestamp"] = created
    if grants is not None:
        obj["metadata"]["annotations"] = {GRANT_ANNOTATION: grants}
    return obj


def keys(tmp_path) -> TenantKeys:
    d = tmp_path / "tenants"
    d.mkdir()
    (d / "team-a").write_text("sk-a\n")
    (d / "team-b.batch").write_text("sk-b\n")  # a tenant of namespace team-b
    (d / "team-c").write_text("sk-c\n")
    return TenantKeys(str(d))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_a_name_belongs_to_its_namespace_and_only_grants_share_it(tmp_path):
    async with LoraEngine("a-chat", served="chat", adapters=("sql",), hold=False) as a_chat, \
            Engine("b-evil", served="sql", hold=False) as b_evil, \
            Engine("b-embed", served="embed", hold=False) as b_embed, \
            Engine("c-embed", served="embed", hold=False) as c_embed:
        # team-b is hostile: an older service serving team-a's adapter name (as its base model), and one serving
        # team-a's base name with no engine at all (a black hole at no cost); it grants team-a its `embed`
        services = [service("team-a", "chat", "chat", created="2026-02-01T00:00:00Z"),
                    service("team-b", "evil", "sql", grants="*", created="2025-01-01T00:00:00Z"),
                    service("team-b", "hole", "chat", grants="team-a", created="2025-01-01T00:00:00Z"),
                    service("team-b", "embed", "embed", grants="team-a")]
        engines = {"chat": a_chat, "evil": b_evil, "embed": b_embed}
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), models_interval=0.1), services, {})
        gw.pools.slices_reset([endpoint_slice(f"{n}-engines", e.url, namespace=ns) for ns, n, e in (
            ("team-a", "chat", a_chat), ("team-b", "evil", b_evil), ("team-b", "embed", b_embed))])
        await until(lambda: len([p for p in gw.pools.all() if p.backends.eligible()]) == 3)
        await until(lambda: ("team-a", "chat") in gw.pools.engine_models)
        try:
            async def ask(key: str, model: str, path: str = "/v1/completions"):
                r = await client.post(path, json={"model": model, "prompt": "x"}, headers=auth(key))
                return r.status, await r.json()

            # team-a's names stay team-a's, whatever team-b serves or grants
            assert await ask("sk-a", "chat") == (200, {"engine": "a-chat", "model": "chat"})
            assert await ask("sk-a", "sql") == (200, {"engine": "a-chat", "model": "sql"})
            assert (await ask("sk-a", "embed"))[1]["engine"] == "b-embed"  # granted to team-a
            assert (await ask("sk-a", "embed", "/v1/embeddings"))[1]["engine"] == "b-embed"  # routed by its model
            # team-b resolves in its own namespace first
            assert (await ask("sk-b", "sql"))[1]["engine"] == "b-evil"
            # team-c is granted only `evil` ("*"): the rest of team-a and team-b look unknown, on every route
            assert (await ask("sk-c", "sql"))[1]["engine"] == "b-evil"
            unknown = await ask("sk-c", "no-such-model")
            for model in ("chat", "embed"):
                status, body = await ask("sk-c", model)
                assert (status, body) == (unknown[0], {"error": {**unknown[1]["error"], "message": unknown[1][
                    "error"]["message"].replace("no-such-model", model)}})
                assert status == 404
                r = await client.post("/tokenize", json={"model": model, "prompt": "x"}, headers=auth("sk-c"))
                assert r.status == 404
                r = await client.post("/v1/embeddings", json={"model": model, "input": "x"}, headers=auth("sk-c"))
                assert r.status == 404
                assert (await client.get(f"/v1/models/{model}", headers=auth("sk-c"))).status == 404
            # /v1/models: what the caller may use, and never an adapter's path
            listed = {c["id"]: c for c in (await (await client.get("/v1/models", headers=auth("sk-a"))).json())[
                "data"]}
            assert set(listed) == {"chat", "sql", "embed"}
            assert listed["sql"]["parent"] == "chat" and listed["sql"]["root"] == "chat"
            assert not [c for c in listed.values() if "/" in str(c.get("root"))]
            listed = {c["id"] for c in (await (await client.get("/v1/models", headers=auth("sk-c"))).json())["data"]}
            assert listed == {"sql"}
            # another namespace granting team-a the same name: refused, never silently re-pointed
            gw.pools.apply(service("team-c", "embed", "embed", grants="team-a"))
            gw.pools.slice_event("ADDED", endpoint_slice("embed-engines", c_embed.url, namespace="team-c"))
            status, body = await ask("sk-a", "embed")
            assert status == 409 and body["error"]["code"] == "model_ambiguous"
            assert "team-b" in body["error"]["message"] and "team-c" in body["error"]["message"]
            assert (await ask("sk-a", "chat"))[1]["engine"] == "a-chat"  # its own names are untouched
            assert {c["id"] for c in (await (await client.get("/v1/models", headers=auth("sk-a"))).json())[
                "data"]} == {"chat", "sql"}
            assert not b_embed.seen[2:] and not c_embed.seen
            assert len(engines["evil"].seen) == 2  # team-b's own request and team-c's granted one, nothing else
        finally:
            await client.close()
            await gw.stop()


async def test_a_flooding_tenant_gets_only_its_share_of_the_waiting_room_and_of_the_body_budget(tmp_path):
    async with Engine("big") as big, Engine("small") as small:
        config = GatewayConfig(tenant_keys=keys(tmp_path), max_queued=8, max_buffered_bytes=4 * 40_000,
                               max_body_bytes=40_000)
        gw, client = await shared(config, [], {})
        gw.pools.reset([service("team-a", "big", "big"), service("team-b", "small", "small")])
        for pool in gw.pools.all():  # one engine slot each: everything else waits in the gateway
            pool.max_inflight = 1
        gw.pools.slices_reset([endpoint_slice("big-engines", big.url, namespace="team-a"),
                               endpoint_slice("small-engines", small.url, namespace="team-b")])
        await until(lambda: all(p.backends.eligible() for p in gw.pools.all()))
        try:
            def send(key: str, model: str, prompt: str = "p"):
                return asyncio.create_task(client.post("/v1/completions", json={"model": model, "prompt": prompt},
                                                       headers=auth(key)))

            flood = [send("sk-a", "big") for _ in range(12)]
            # one runs; a tenant alone may hold half of the waiting room (4 of 8); the rest is refused at once
            await until(lambda: sum(t.done() for t in flood) == 7 and len(big.seen) == 1)
            refused = [t.result() for t in flood if t.done()]
            flood = [t for t in flood if not t.done()]
            assert {r.status for r in refused} == {429}
            assert {(await r.json())["error"]["code"] for r in refused} == {"tenant_queue_full"}
            assert len(gw.pools.resolve("big", "team-a").queue) == 4
            # team-b's requests still find room: one runs, the next waits its turn
            cold = [send("sk-b", "small") for _ in range(2)]
            await until(lambda: len(small.seen) == 1 and len(gw.pools.resolve("small", "team-b").queue) == 1)
            small.release(0)
            await until(lambda: len(small.seen) == 2)
            small.release(1)
            assert [(await t).status for t in cold] == [200, 200]
            for i in range(5):
                big.release(i)
                await until(lambda: len(big.seen) == min(i + 2, 5))
            assert [(await t).status for t in flood] == [200] * 5
            # the body budget: four 40 kB bodies would take all of it; team-a gets half while alone
            bodies = [send("sk-a", "big", "x" * 39_000) for _ in range(3)]
            await until(lambda: len(big.seen) == 6 and sum(t.done() for t in bodies) == 1)
            (third,) = [t.result() for t in bodies if t.done()]
            bodies = [t for t in bodies if not t.done()]
            assert third.status == 429 and (await third.json())["error"]["code"] == "tenant_buffered"
            other = send("sk-b", "small", "y" * 39_000)  # another tenant's large body still fits
            await until(lambda: len(small.seen) == 3)
            small.release(2)
            assert (await other).status == 200
            big.release(5)
            await until(lambda: len(big.seen) == 7)
            big.release(6)
            assert [(await t).status for t in bodies] == [200, 200]
        finally:
            await client.close()
            await gw.stop()


async def test_per_tenant_quotas_answer_429_with_retry_after_and_the_openai_rate_limit_headers(tmp_path):
    from shoal.operator.gateway.quotas import QuotaPolicy

    async with Engine("a", served="chat", hold=False) as engine:
        config = GatewayConfig(tenant_keys=keys(tmp_path),
                               quotas=QuotaPolicy(requests_per_minute=2, tokens_per_minute=3000))
        gw, client = await shared(config, [], {})
        gw.pools.reset([service("team-a", "chat", "chat", grants="*")])
        gw.pools.slices_reset([endpoint_slice("chat-engines", engine.url, namespace="team-a")])
        await until(lambda: all(p.backends.eligible() for p in gw.pools.all()))
        # fair queuing is on without engine.maxNumSeqs: the gateway queues where the engine's default would
        assert [p.max_inflight for p in gw.pools.all()] == [256]
        try:
            async def ask(key: str, max_tokens: int = 10):
                return await client.post("/v1/completions", json={"model": "chat", "prompt": "x",
                                                                  "max_tokens": max_tokens}, headers=auth(key))

            r = await ask("sk-a")
            assert r.status == 200 and r.headers["x-ratelimit-limit-requests"] == "2"
            assert r.headers["x-ratelimit-remaining-requests"] == "1"
            assert r.headers["x-ratelimit-limit-tokens"] == "3000"
            assert int(r.headers["x-ratelimit-remaining-tokens"]) < 3000
            r = await ask("sk-a", max_tokens=5000)  # more than the whole minute's tokens: waits for a full bucket
            assert r.status == 429 and (await r.json())["error"]["code"] == "tenant_tokens_per_minute"
            assert int(r.headers["Retry-After"]) >= 1 and int(r.headers["retry-after-ms"]) > 0
            assert (await ask("sk-a")).status == 200
            r = await ask("sk-a")
            assert r.status == 429 and (await r.json())["error"]["code"] == "tenant_requests_per_minute"
            assert r.headers["x-ratelimit-remaining-requests"] == "0" and r.headers["x-ratelimit-reset-requests"]
            assert 1 <= int(r.headers["Retry-After"]) <= 30
            # on Anthropic's route the same refusal is in Anthropic's shape (what its client reads), key in x-api-key
            r = await client.post("/v1/messages", json={"model": "chat", "max_tokens": 4, "messages": [
                {"role": "user", "content": "x"}]}, headers={"x-api-key": "sk-a"})
            body = await r.json()
            assert r.status == 429 and body == {"type": "error", "error": {
                "type": "rate_limit_error", "message": body["error"]["message"]}} and "minute" in body["error"]["message"]
            assert 1 <= int(r.headers["Retry-After"]) <= 30 and r.headers["x-ratelimit-remaining-requests"] == "0"
            # another tenant's quota is its own
            assert (await ask("sk-c")).status == 200
            assert len(engine.seen) == 3
        finally:
            await client.close()
            await gw.stop()


async def test_priorities_are_bounded_by_what_the_platform_allows_each_namespace_and_a_clamp_is_an_event():
    from shoal.operator.gateway.discovery import KubeAPI

    events: list[dict] = []

    async def record(request: web.Request) -> web.Response:
        events.append({**await request.json(), "path": request.path})
        return web.json_response({}, status=201)

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/{ns}/events", record)
    runner, url = await serve(app)
    api = KubeAPI(url)
    config = GatewayConfig(max_priority=0, namespace_max_priority={"team-a": 5})
    gw, client = await shared(config, [], {}, api=api)
    try:
        a = isvc("chat", "chat", namespace="team-a", priority=9)
        b = isvc("batch", "batch", namespace="team-b", priority=7, adapters=[("urgent", 1000), "plain"])
        low = isvc("low", "low", namespace="team-b", priority=-3)
        for obj, uid in ((a, "u-a"), (b, "u-b"), (low, "u-low")):
            obj["metadata"]["uid"] = uid
        gw.pools.reset([a, b, low])
        pools = {p.name: p for p in gw.pools.all()}
        assert pools["chat"].priority == 5  # team-a may use up to 5
        assert pools["batch"].priority == 0 and pools["batch"].priority_of("urgent") == 0
        assert pools["low"].priority == -3  # lowering oneself is always allowed
        await until(lambda: len(events) == 2)
        by_name = {e["involvedObject"]["name"]: e for e in events}
        assert set(by_name) == {"chat", "batch"}
        assert all(e["reason"] == "PriorityClamped" and e["type"] == "Warning" for e in events)
        assert by_name["chat"]["involvedObject"]["uid"] == "u-a" and by_name["chat"]["path"].startswith(
            "/api/v1/namespaces/team-a/")
        assert "1000" in by_name["batch"]["message"] and "(0)" in by_name["batch"]["message"]
        gw.pools.apply({**b, "metadata": {**b["metadata"], "resourceVersion": "2"}})  # the same spec: no new event
        await asyncio.sleep(0.1)
        assert len(events) == 2
    finally:
        await client.close()
        await gw.stop()
        await runner.cleanup()


async def test_during_a_rotation_the_shared_gateway_retries_a_401_once_with_the_engines_other_key(tmp_path):
    from shoal.operator.gateway.tenants import EngineKeys

    class KeyedEngine(Engine):
        accepted = "old-key"

        async def complete(self, request):
            if request.headers.get("Authorization") != f"Bearer {self.accepted}":
                self.seen.append({"auth": request.headers.get("Authorization"), "refused": True})
                return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
            return await super().complete(request)

    (tmp_path / "engines").mkdir()
    engine_keys = tmp_path / "engines" / "team-a.chat"
    engine_keys.write_text("new-key\nold-key\n")  # rotation under way: the newest first
    async with KeyedEngine("chat", served="chat", hold=False) as engine:
        config = GatewayConfig(tenant_keys=keys(tmp_path), engine_keys=EngineKeys(str(tmp_path / "engines"), 0))
        gw, client = await shared(config, [], {})
        gw.pools.reset([service("team-a", "chat", "chat")])
        gw.pools.slices_reset([endpoint_slice("chat-engines", engine.url, namespace="team-a")])
        await until(lambda: all(p.backends.eligible() for p in gw.pools.all()))
        try:
            async def ask():
                return await client.post("/v1/completions", json={"model": "chat", "prompt": "x"}, headers=auth("sk-a"))

            r = await ask()  # the engine has not re-read its Secret yet: the old key, on the second try
            assert r.status == 200 and [s["auth"] for s in engine.seen] == ["Bearer new-key", "Bearer old-key"]
            (backend,) = gw.pools.all()[0].backends.all()
            assert backend.failures == 0
            engine.accepted = "new-key"  # it did
            engine.seen.clear()
            assert (await ask()).status == 200 and [s["auth"] for s in engine.seen] == ["Bearer new-key"]
            engine_keys.write_text("new-key\n")  # the rotation is over
            engine.accepted = "old-key"  # an engine that somehow kept the old key only: one try, 401 passed on
            engine.seen.clear()
            assert (await ask()).status == 401 and len(engine.seen) == 1
        finally:
            await client.close()
            await gw.stop()


async def test_the_shared_gateway_routes_no_services_prompt_by_anothers(tmp_path):
    """The shared gateway's approximate prefix index (prefix-load, and precise-prefix's fallback), one for every
    pool, matches a prompt only against the asking pool's own engines: a prompt team-a sent again and again routes
    team-b's identical request (the same model name) as if never seen; and a request with vLLM's cache_salt is
    indexed apart from the same prompt unsalted. (precise-prefix's own indexes, one per pool:
    test_shared_precise.py.)"""
    async with Engine("a1", served="m", hold=False) as a1, Engine("a2", served="m", hold=False) as a2, \
            Engine("b1", served="m", hold=False) as b1, Engine("b2", served="m", hold=False) as b2:
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), routing="prefix-load"),
                                  [service("team-a", "m", "m"), service("team-b", "m", "m")], {})
        slices = [endpoint_slice("m-engines", e.url, namespace=ns) for ns, e in (
            ("team-a", a1), ("team-a", a2), ("team-b", b1), ("team-b", b2))]
        for i, s in enumerate(slices):
            s["metadata"]["name"] += str(i)  # two slices per service
        gw.pools.slices_reset(slices)
        await until(lambda: len([p for p in gw.pools.all() if len(p.backends.eligible()) == 2]) == 2)
        try:
            body = {"model": "m", "prompt": "the same long system prompt " * 20}
            for _ in range(3):
                r = await client.post("/v1/completions", json=body, headers=auth("sk-a"))
                assert r.status == 200
            pools = {p.namespace: p for p in gw.pools.all()}
            hashes = gw.prompt_hashes("/v1/completions", body, "m", pools["team-b"])
            assert gw.prompt_hashes("/v1/completions", body, "m", pools["team-a"]) == hashes  # one shared index
            now = asyncio.get_running_loop().time()
            assert pools["team-a"].router.pick(pools["team-a"].backends.eligible(), hashes, now).decision == \
                "affinity"
            pick = pools["team-b"].router.pick(pools["team-b"].backends.eligible(), hashes, now)
            assert (pick.decision, pick.matched_blocks) == ("cold", 0)
            salted = gw.prompt_hashes("/v1/completions", {**body, "cache_salt": "team-a-secret"}, "m", pools["team-a"])
            assert not set(salted) & set(hashes)
        finally:
            await client.close()
            await gw.stop()
