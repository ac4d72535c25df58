"""The adapter-sync sidecar's loop (operator/podtools/adapter_sync.py) against a stand-in engine that speaks vLLM's
adapter endpoints: what it loads, reloads, unloads, leaves alone and retries. The real engine and the operator are
in tests/operator/test_adapters_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

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
    def __init__(self, refuse: set[str] = frozenset(), delay: float = 0.0):
        self.delay = delay  # seconds each load takes
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
            await asyncio.sleep(self.delay)
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
        # remembered across sidecar restarts: what it loaded, and the snapshot it fetched (v1's is gone)
        assert json.loads((tmp_path / "state.json").read_text()) == {"managed": ["hub"], "fetched": ["/hub/org/x@v2"]}

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


async def test_a_long_pass_of_slow_loads_keeps_the_sidecar_alive(tmp_path, monkeypatch):
    """Eight slow loads: one after another the pass outlasted the liveness bound (one load's timeout plus slack),
    the kubelet restarted the sidecar mid-pass and it started over. Loads run a few at a time and each beats the
    heart, so /livez stays 200 for as long as no single load is stuck."""
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    fake = FakeEngine(delay=0.3)
    monkeypatch.setenv("SHOAL_API_KEY", "k")
    monkeypatch.setattr(adapter_sync, "LOAD_TIMEOUT", 0.5)  # one load's bound ...
    monkeypatch.setattr(adapter_sync, "LIVENESS_SLACK", 0.2)  # ... plus slack: 0.7 s, while 8 loads take 2.4 s
    cfg = tmp_path / "adapters.json"
    write(cfg, {f"a{i}": f"/a{i}" for i in range(8)})
    async with TestServer(fake.app()) as engine_server:
        syncer = adapter_sync.Syncer(cfg, str(engine_server.make_url("")).rstrip("/"), tmp_path / "state.json",
                                     interval=0.01)
        async with TestClient(TestServer(adapter_sync.make_app(syncer))) as probe:
            syncer.session = aiohttp.ClientSession()
            try:
                alive = []
                pass_ = asyncio.create_task(syncer.sync_once())
                while not pass_.done():
                    alive.append((await probe.get("/livez")).status)
                    await asyncio.sleep(0.05)
                await pass_
            finally:
                await syncer.session.close()
        assert alive and set(alive) == {200}, alive
        assert {a["state"] for a in syncer.status()["adapters"]} == {"Loaded"}


async def test_an_adapter_trained_for_another_base_model_is_refused(engine, tmp_path, monkeypatch):
    """adapter_config.json names the base model an adapter was trained for: one of another model with the same
    shapes would load silently and answer nonsense, so it is refused with a clear reason (the operator shows it in
    status.adapters and an AdapterLoadFailed Event) and never sent to the engine."""
    import aiohttp

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    for name, base in (("mine", "Org/Base-7B"), ("theirs", "org/other-7b"), ("local", "/home/me/base")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 8}))
    cfg = tmp_path / "adapters.json"
    cfg.write_text(json.dumps({"baseModel": "org/base-7b", "adapters": [
        {"name": n, "source": str(tmp_path / n)} for n in ("mine", "theirs", "local")]}))
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01)
    syncer.session = aiohttp.ClientSession()
    try:
        await syncer.sync_once()
    finally:
        await syncer.session.close()
    states = {a["name"]: (a["state"], a["message"]) for a in syncer.status()["adapters"]}
    assert states["mine"] == ("Loaded", None) and states["local"] == ("Loaded", None)  # same id; unknown base
    assert states["theirs"][0] == "Failed"
    assert "trained for base model org/other-7b" in states["theirs"][1] and "serves org/base-7b" in states["theirs"][1]
    assert ("load", "theirs") not in engine.calls


def fake_hub_snapshot(cache, repo: str, commit: str, content: bytes) -> str:
    """A hub snapshot laid out as huggingface_hub stores it: blobs, a snapshot of symlinks, a ref."""
    import hashlib

    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    blob = hashlib.sha256(content).hexdigest()
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs" / blob).write_bytes(content)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_model.safetensors").symlink_to(f"../../blobs/{blob}")
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return str(snapshot)


async def test_removed_adapters_and_old_revisions_leave_the_cache(engine, tmp_path, monkeypatch):
    """Each pod's cache volume held every adapter and revision it ever fetched: removed adapters and replaced
    revisions are now deleted (with their blobs), and the model's and other adapters' files are left alone."""
    import aiohttp

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    cache = tmp_path / "hub"
    snapshots = {"hf://org/x@v1": fake_hub_snapshot(cache, "org/x", "a" * 40, b"v1 weights"),
                 "hf://org/x@v2": fake_hub_snapshot(cache, "org/x", "b" * 40, b"v2 weights"),
                 "hf://org/y": fake_hub_snapshot(cache, "org/y", "c" * 40, b"y weights")}
    model = fake_hub_snapshot(cache, "org/base", "d" * 40, b"the model")  # fetched by the init container
    monkeypatch.setattr(adapter_sync, "fetch", lambda source: snapshots[source])
    cfg = tmp_path / "adapters.json"
    write(cfg, {"x": "hf://org/x@v1", "y": "hf://org/y"})
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01)
    syncer.session = aiohttp.ClientSession()
    try:
        await passes_until(syncer, lambda: {engine.loaded.get("x"), engine.loaded.get("y")} == {
            snapshots["hf://org/x@v1"], snapshots["hf://org/y"]}, "x and y loaded")
        write(cfg, {"x": "hf://org/x@v2"})  # a new revision of x, and y removed
        await passes_until(syncer, lambda: engine.loaded.get("x") == snapshots["hf://org/x@v2"]
                           and "y" not in engine.loaded, "x's new revision loaded and y unloaded")
    finally:
        await syncer.session.close()
    assert not (cache / "models--org--y").exists()
    assert not (cache / "models--org--x" / "snapshots" / ("a" * 40)).exists()
    assert (cache / "models--org--x" / "snapshots" / ("b" * 40) / "adapter_model.safetensors").read_bytes() == \
        b"v2 weights"
    assert len(list((cache / "models--org--x" / "blobs").iterdir())) == 1  # v1's blob went with it
    assert (Path(model) / "adapter_model.safetensors").read_bytes() == b"the model"


async def test_a_shared_cache_keeps_unused_snapshots(engine, tmp_path, monkeypatch):
    import aiohttp

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    cache = tmp_path / "hub"
    old = fake_hub_snapshot(cache, "org/x", "a" * 40, b"v1 weights")
    new = fake_hub_snapshot(cache, "org/x", "b" * 40, b"v2 weights")
    monkeypatch.setattr(adapter_sync, "fetch", lambda source: {"hf://org/x@v1": old, "hf://org/x@v2": new}[source])
    cfg = tmp_path / "adapters.json"
    write(cfg, {"x": "hf://org/x@v1"})
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01, collect=False)
    syncer.session = aiohttp.ClientSession()
    try:
        await passes_until(syncer, lambda: engine.loaded.get("x") == old, "v1 loaded")
        write(cfg, {"x": "hf://org/x@v2"})
        await passes_until(syncer, lambda: engine.loaded.get("x") == new, "v2 loaded")
    finally:
        await syncer.session.close()
    assert Path(old).is_dir() and Path(new).is_dir()  # another pod's list may still name v1


async def test_no_download_starts_once_the_cache_is_at_its_cap(engine, tmp_path, monkeypatch):
    """The pod's cache volume has a size limit (the kubelet evicts the pod past it): once the cache holds the
    sidecar's cap, an adapter to download fails with the reason, and is fetched once space is freed."""
    import aiohttp
    from huggingface_hub import constants

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    model = fake_hub_snapshot(cache, "org/base", "d" * 40, b"m" * 4000)  # the model: 4000 bytes of the cache
    fetched = []
    monkeypatch.setattr(adapter_sync, "fetch", lambda source: fetched.append(source) or model)
    cfg = tmp_path / "adapters.json"
    write(cfg, {"x": "hf://org/x"})
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01, max_cache_bytes=3000)
    syncer.session = aiohttp.ClientSession()
    try:
        await syncer.sync_once()
        (x,) = syncer.status()["adapters"]
        assert x["state"] == "Failed" and "at its cap" in x["message"] and fetched == []
        syncer.max_cache_bytes = 10_000  # room again (here: a higher cap): retried after its backoff
        syncer.adapters["x"].retry_at = 0
        await passes_until(syncer, lambda: engine.loaded.get("x") == model, "x fetched and loaded")
    finally:
        await syncer.session.close()
    assert fetched == ["hf://org/x"]


async def test_hub_downloads_are_spread_out_and_few_at_a_time(engine, tmp_path, monkeypatch):
    """A list change reaches every pod at about the same moment: each download waits a random moment (up to the
    jitter) and at most DOWNLOADS run at once in a pod, instead of every adapter of every pod at once."""
    import threading

    import aiohttp

    monkeypatch.setenv("SHOAL_API_KEY", "k")
    lock, running, most, starts = threading.Lock(), [0], [0], []

    def slow_fetch(source):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            starts.append(time.monotonic())
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return f"/hub/{source[5:]}"
    monkeypatch.setattr(adapter_sync, "fetch", slow_fetch)
    cfg = tmp_path / "adapters.json"
    write(cfg, {f"a{i}": f"hf://org/a{i}" for i in range(6)})
    syncer = adapter_sync.Syncer(cfg, engine.url, tmp_path / "state.json", interval=0.01, jitter=0.3)
    syncer.session = aiohttp.ClientSession()
    began = time.monotonic()
    try:
        await passes_until(syncer, lambda: len(engine.loaded) == 7, "six hub adapters loaded")
    finally:
        await syncer.session.close()
    assert most[0] <= adapter_sync.DOWNLOADS and len(starts) == 6
    assert min(starts) - began < 0.3 + 0.1 and max(starts) - began >= 0.2 * (6 // adapter_sync.DOWNLOADS - 1)


def test_the_newest_key_of_a_rotated_secret_is_read_at_each_call(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("old\n")
    monkeypatch.setenv("SHOAL_API_KEY_FILE", str(keys))
    syncer = adapter_sync.Syncer(tmp_path / "adapters.json", "http://127.0.0.1:1", tmp_path / "state.json")
    assert syncer._headers() == {"Authorization": "Bearer old"}
    keys.write_text("\nnew\nold\n")  # the rollover: the newest first
    assert syncer._headers() == {"Authorization": "Bearer new"}
