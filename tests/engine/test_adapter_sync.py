"""The adapter-sync sidecar's loop (engine/tools/adapter_sync.py) against a stand-in engine that speaks vLLM's
adapter endpoints: what it loads, reloads, unloads, leaves alone and retries. The real engine and the operator are
in tests/operator/test_adapters_e2e.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from shoal.engine.tools import adapter_sync


class FakeEngine:
    def __init__(self, refuse: set[str] = frozenset()):
        self.loaded: dict[str, str] = {"static": "/from/lora-modules"}  # as --lora-modules would have it
        self.refuse = set(refuse)
        self.calls: list[tuple[str, str]] = []

    def app(self) -> web.Application:
        async def models(request):
            assert request.headers.get("Authorization") == "Bearer k"
            cards = [{"id": "base", "root": "/m", "parent": None}]
            cards += [{"id": n, "root": p, "parent": "base"} for n, p in self.loaded.items()]
            return web.json_response({"data": cards})

        async def load(request):
            body = await request.json()
            self.calls.append(("load", body["lora_name"]))
            if body["lora_path"] in self.refuse:
                return web.json_response({"error": {"message": "rank 32 above 16"}}, status=400)
            self.loaded[body["lora_name"]] = body["lora_path"]
            return web.Response(text="ok")

        async def unload(request):
            body = await request.json()
            self.calls.append(("unload", body["lora_name"]))
            self.loaded.pop(body["lora_name"], None)
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/v1/unload_lora_adapter", unload)
        return app


@pytest.fixture
async def engine():
    from aiohttp.test_utils import TestServer

    fake = FakeEngine(refuse={"/bad"})
    async with TestServer(fake.app()) as server:
        fake.url = str(server.make_url("")).rstrip("/")
        yield fake


def write(path, adapters: dict[str, str]) -> None:
    path.write_text(json.dumps({"adapters": [{"name": n, "source": s} for n, s in adapters.items()]}))


async def test_the_loop_converges_and_touches_only_its_own(engine, tmp_path, monkeypatch, caplog):
    import aiohttp

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    fetched = []
    monkeypatch.setattr(adapter_sync, "fetch", lambda source: fetched.append(source) or f"/hub/{source[5:]}")
    cfg = tmp_path / "adapters.json"
    write(cfg, {"a": "/a", "bad": "/bad", "hub": "hf://org/x@v1"})
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01)
    syncer.session = aiohttp.ClientSession()
    try:
        for _ in range(50):  # a hub adapter downloads in a thread: passes until it is loaded
            await syncer.sync_once()
            if syncer.settled_once:
                break
        states = {a["name"]: (a["state"], a["message"]) for a in syncer.status()["adapters"]}
        assert states == {"a": ("Loaded", None), "hub": ("Loaded", None), "bad": ("Failed", "400: rank 32 above 16")}
        assert engine.loaded == {"static": "/from/lora-modules", "a": "/a", "hub": "/hub/org/x@v1"}
        assert fetched == ["hf://org/x@v1"]

        # a refusal is not retried while the source stays; a new revision reloads; a removed adapter is unloaded,
        # the one it did not load (`static`) is left alone
        engine.calls.clear()
        write(cfg, {"bad": "/bad", "hub": "hf://org/x@v2"})
        for _ in range(50):
            await syncer.sync_once()
            if engine.loaded.get("hub") == "/hub/org/x@v2":
                break
        assert engine.loaded == {"static": "/from/lora-modules", "hub": "/hub/org/x@v2"}
        assert ("load", "bad") not in engine.calls and ("unload", "static") not in engine.calls
        assert engine.calls == [("unload", "a"), ("unload", "hub"), ("load", "hub")]
        assert json.loads((tmp_path / "state.json").read_text()) == ["hub"]  # remembered across sidecar restarts

        # an engine that restarted in place lost its adapters: not ready again until they are back
        assert syncer.settled_once
        del engine.loaded["hub"]
        await syncer.sync_once()
        assert "the engine lost adapters hub (restarted?)" in caplog.text
        assert engine.loaded["hub"] == "/hub/org/x@v2" and syncer.settled_once

        # a name the engine got elsewhere is never replaced
        write(cfg, {"static": "/mine"})
        await syncer.sync_once()
        static = syncer.status()["adapters"][0]
        assert static["state"] == "Failed" and "did not load" in static["message"]
        assert engine.loaded["static"] == "/from/lora-modules"
    finally:
        await syncer.session.close()


async def test_readiness_waits_for_the_first_list_and_workers_are_ready_at_once(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    syncer = adapter_sync.Syncer(tmp_path / "none.json", "http://127.0.0.1:9", tmp_path / "s.json")
    app = adapter_sync.make_app(syncer)
    worker = adapter_sync.make_app(adapter_sync.Syncer(tmp_path / "none.json", "http://127.0.0.1:9",
                                                       tmp_path / "s.json", worker=True))
    for application, status in ((app, 503), (worker, 200)):
        async with TestClient(TestServer(application)) as client:
            assert (await client.get("/readyz")).status == status
            assert (await client.get("/livez")).status == 200


def test_the_newest_key_of_a_rotated_secret_is_read_at_each_call(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("old\n")
    monkeypatch.setenv("SHOAL_API_KEY_FILE", str(keys))
    syncer = adapter_sync.Syncer(tmp_path / "adapters.json", "http://127.0.0.1:1", tmp_path / "state.json")
    assert syncer._headers() == {"Authorization": "Bearer old"}
    keys.write_text("\nnew\nold\n")  # the rollover: the newest first
    assert syncer._headers() == {"Authorization": "Bearer new"}
