"""Tenancy at the shared gateway, in-process against stand-in engines (the real-process version is
tests/operator/test_shared_gateway_e2e.py): names belong to their namespace, a tenant uses its own namespace's
models and those of namespaces that grant it, on every route, and what it may not use looks unknown."""

from __future__ import annotations

from aiohttp import web

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
            assert not b_embed.seen[1:] and not c_embed.seen
            assert len(engines["evil"].seen) == 2  # team-b's own request and team-c's granted one, nothing else
        finally:
            await client.close()
            await gw.stop()
