"""The adapter-sync sidecar's loop (operator/podtools/adapter_sync.py) against a stand-in engine that speaks vLLM's
adapter endpoints: what it loads, reloads, unloads, leaves alone and retries. The real engine and the operator are
in tests/operator/test_adapters_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from prockit import EVENT_BOUND

from shoal.operator.podtools import adapter_sync


async def passes_until(syncer, done, what: str) -> None:
    """Sync passes until `done()`, bounded by time (not by a count of passes, which a loaded machine outruns)."""
    deadline = time.monotonic() + EVENT_BOUND
    while True:
        await syncer.sync_once()
        if done():
            return
        assert time.monotonic() < deadline, f"waited {EVENT_BOUND:.0f} s of sync passes for {what}"
        await asyncio.sleep(0.01)


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
        # a hub adapter downloads in a thread: passes until it is loaded
        await passes_until(syncer, lambda: syncer.settled_once, "the first list to settle")
        states = {a["name"]: (a["state"], a["message"]) for a in syncer.status()["adapters"]}
        assert states == {"a": ("Loaded", None), "hub": ("Loaded", None), "bad": ("Failed", "400: rank 32 above 16")}
        assert engine.loaded == {"static": "/from/lora-modules", "a": "/a", "hub": "/hub/org/x@v1"}
        assert fetched == ["hf://org/x@v1"]

        # a refusal is not retried while the source stays; a new revision reloads; a removed adapter is unloaded,
        # the one it did not load (`static`) is left alone
        engine.calls.clear()
        write(cfg, {"bad": "/bad", "hub": "hf://org/x@v2"})
        await passes_until(syncer, lambda: engine.loaded.get("hub") == "/hub/org/x@v2", "hub@v2 to be loaded")
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
