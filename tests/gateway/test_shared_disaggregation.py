"""Prefill/decode disaggregation through the shared gateway: a service with spec.prefill has its prefill engines
(`<name>-prefill`'s EndpointSlices) in its pool, each completion's prefill goes there first and its decode to the
pool's engine with the prefill's kv_transfer_params, as the service's own gateway does (disaggregation.py); other
services, and this one when its prefill engines are gone, prefill on their own engines. In-process, with stand-in
engines (tests/gateway/test_disaggregation.py runs real Shoal engines pulling the KV)."""

from __future__ import annotations

from shoal.operator.gateway.proxy import GatewayConfig

from .test_admission import Engine, endpoint_slice, isvc, shared, until


class ChatEngine(Engine):
    """The stand-in engine, answering chats as completions."""

    def __init__(self, name: str, served: str):
        super().__init__(name, served=served, hold=False)
        self.server.app.router.add_post("/v1/chat/completions", self.complete)


class PrefillEngine(ChatEngine):
    """A KV producer: answers a prefill with where its KV can be pulled from."""

    async def complete(self, request):
        body = await request.json()
        self.seen.append({"body": body, "auth": request.headers.get("Authorization")})
        return self.answer(body)

    def answer(self, body):
        from aiohttp import web

        return web.json_response({"engine": self.name, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 8000,
            "remote_request_id": f"p-{len(self.seen)}"}})


def disaggregated(name: str, served: str) -> dict:
    obj = isvc(name, served)
    obj["spec"]["prefill"] = {"replicas": 1}
    return obj


def counted(gw, outcome: str) -> float:
    return gw.metrics.remote_prefills.labels(outcome)._value.get()


async def test_the_shared_gateway_prefills_on_the_services_prefill_engines_and_decodes_on_its_engines():
    async with ChatEngine("decode", "chat") as decode, ChatEngine("plain", "other") as plain, \
            PrefillEngine("prefill", "chat") as prefill:
        gw, client = await shared(GatewayConfig(), [disaggregated("llm", "chat"), isvc("other", "other")],
                                  {"llm": decode, "other": plain})
        slices = [endpoint_slice("llm-engines", decode.url), endpoint_slice("other-engines", plain.url)]
        try:
            gw.pools.slices_reset(slices + [endpoint_slice("llm-prefill", prefill.url)])
            pool = gw.pools.pools[("team", "llm")]
            await until(lambda: pool.remote_prefill is not None and pool.remote_prefill.backends.eligible())
            assert gw.pools.pools[("team", "other")].remote_prefill is None
            bogus = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
            r = await client.post("/v1/completions", json={"model": "chat", "prompt": "hello", "max_tokens": 8,
                                                           "kv_transfer_params": bogus})
            assert r.status == 200 and (await r.json())["engine"] == "decode"
            sent = prefill.seen[-1]["body"]
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert sent["kv_transfer_params"] == {"do_remote_decode": True}  # never the client's own
            got = decode.seen[-1]["body"]
            assert got["kv_transfer_params"]["remote_request_id"] == "p-1" and got["max_tokens"] == 8
            assert counted(gw, "ok") == 1
            # chat too; another service's requests never go to this service's prefill engines
            r = await client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 4,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status == 200 and (await r.json())["engine"] == "decode"
            assert len(prefill.seen) == 2 and prefill.seen[-1]["body"]["max_tokens"] == 1
            assert decode.seen[-1]["body"]["kv_transfer_params"]["remote_request_id"] == "p-2"
            r = await client.post("/v1/completions", json={"model": "other", "prompt": "hello"})
            assert r.status == 200 and "kv_transfer_params" not in plain.seen[-1]["body"]
            assert len(prefill.seen) == 2
            # the prefill engines gone (their slice lists none Ready): the decode engine prefills on its own
            gw.pools.slices_reset(slices + [endpoint_slice("llm-prefill", prefill.url, ready=False)])
            await until(lambda: not pool.remote_prefill.backends.eligible())
            r = await client.post("/v1/completions", json={"model": "chat", "prompt": "again"})
            assert r.status == 200 and "kv_transfer_params" not in decode.seen[-1]["body"]
            assert counted(gw, "unavailable") == 1 and len(prefill.seen) == 2
            # spec.prefill removed: the pool has no prefill role any more
            gw.pools.reset([isvc("llm", "chat"), isvc("other", "other")])
            await until(lambda: gw.pools.pools[("team", "llm")].remote_prefill is None)
        finally:
            await client.close()
            await gw.stop()
