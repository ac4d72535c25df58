"""`shoal-engine sync-adapters`: the in-pod loop that keeps an engine's LoRA adapters equal to a list.

The operator renders an InferenceService's `spec.adapters` into the ConfigMap `<name>-adapters`, which every
engine pod mounts; this loop runs next to the engine (a sidecar container) and, every --interval seconds:
  - reads the list (`{"adapters": [{"name", "source"}]}`; a source is a local directory, or `hf://org/name[@rev]`,
    which it fetches into the pod's cache volume with the same code as the model's init container);
  - asks the engine what it serves (GET /v1/models: adapters are the cards with a `parent`);
  - loads what is missing (POST /v1/load_lora_adapter), reloads what changed source, and unloads what it loaded
    before and the list no longer names (POST /v1/unload_lora_adapter) — vLLM's endpoints, so it drives both
    runtimes, with the engine's API key ($SHOAL_API_KEY). Adapters it did not load (--lora-modules) are left alone.

The kubelet refreshes a mounted ConfigMap in place, so a changed list reaches the running engine without a
restart (within the kubelet's refresh, about a minute by default). A new pod is Ready only once its adapters are:
/readyz (the sidecar's readiness probe) answers 200 after the first pass that settled every adapter, loaded or
failed, and from then on (a bad adapter never takes a serving pod out) unless the engine restarts in place and
loses its adapters: then again only once they are back. A failed load is kept with the engine's
reason; a refusal (4xx: rank too high, wrong base model, missing file) is not retried until the adapter's source
changes, anything else (engine busy, hub unreachable) is retried with backoff.

/status (JSON) reports the list it applied (the sha256 of the file, which the operator compares with the
ConfigMap it rendered) and each adapter's state: the operator reads it from every serving pod into
status.adapters. Ranks > 0 of a multi-pod replica serve no API: there the loop only answers its probes.
No torch: the sidecar is small.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("shoal.adapter_sync")

HF = "hf://"
FINAL = ("Loaded", "Failed")
MODELS_TIMEOUT = 5.0
LOAD_TIMEOUT = 600.0  # a load reads the adapter from disk and copies it to every rank
MAX_BACKOFF = 300.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the adapter list (the mounted ConfigMap's adapters.json)")
    parser.add_argument("--engine-url", default="http://127.0.0.1:8000", help="the engine in this pod")
    parser.add_argument("--host", default="0.0.0.0", help="bind address of /readyz, /livez and /status")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between passes")
    parser.add_argument("--state-file", default=None,
                        help="where the names of the adapters this loop loaded are kept across its restarts "
                             "(default: $TMPDIR/shoal-adapter-sync.json)")


def parse_source(source: str) -> tuple[str, str | None] | None:
    """`hf://org/name[@revision]` -> (repo id, revision); None for a local path."""
    if not source.startswith(HF):
        return None
    repo, _, revision = source[len(HF):].partition("@")
    return repo, revision or None


def fetch(source: str) -> str:
    """The local snapshot directory of a hub adapter, downloaded (resumable, transient failures retried) into the
    Hugging Face cache of this pod ($HF_HOME on the cache volume)."""
    from huggingface_hub import snapshot_download

    from shoal.engine.tools.download import PATTERNS, with_retries

    repo, revision = parse_source(source)
    return with_retries(lambda: snapshot_download(repo, revision=revision, allow_patterns=PATTERNS), source,
                        max_retries=5, backoff=2.0)


def _error_message(status: int, text: str) -> str:
    """An engine's error answer in one line: OpenAI's {"error": {"message"}}, vLLM's {"message"}, or the text."""
    try:
        body = json.loads(text)
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = inner.get("message") or text
    except (ValueError, AttributeError):
        message = text
    return f"{status}: {str(message).strip()[:1000]}"



def newest_key(path: str | None) -> str | None:
    """The first line of the engine's mounted key Secret (the newest key during a rotation), read anew each time."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return next((line.strip() for line in f if line.strip()), None)
    except OSError:
        return None

@dataclass
class Adapter:
    name: str
    source: str
    state: str = "Pending"
    message: str | None = None
    path: str | None = None  # the local directory the engine loads (the source itself, or its hub snapshot)
    refused: str | None = None  # the path the engine refused (4xx): not retried while the source stays
    retry_at: float = 0.0
    failures: int = 0
    download: asyncio.Task | None = None

    def report(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "state": self.state, "message": self.message}


@dataclass
class Syncer:
    config: Path
    engine_url: str
    state_file: Path
    interval: float = 2.0
    worker: bool = False  # a rank > 0 of a multi-pod replica: no API to drive
    adapters: dict[str, Adapter] = field(default_factory=dict)
    managed: set[str] = field(default_factory=set)  # names this loop loaded (persisted in state_file)
    applied: str | None = None  # sha256 of the list the last pass applied
    engine: str = "unknown"
    settled_once: bool = False
    heartbeat: float = field(default_factory=time.monotonic)
    session: Any = None

    def __post_init__(self) -> None:
        try:
            self.managed = set(json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            self.managed = set()

    # ---- I/O with the engine ---------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        key = newest_key(os.environ.get("SHOAL_API_KEY_FILE")) or os.environ.get("SHOAL_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _engine_adapters(self) -> dict[str, str] | None:
        """{adapter name: root (the path it was loaded from)} from the engine's /v1/models; None if unreachable."""
        import aiohttp

        try:
            async with self.session.get(f"{self.engine_url}/v1/models", headers=self._headers(),
                                        timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT)) as r:
                text = await r.text()
                if r.status != 200:
                    self.engine = f"GET /v1/models answered {_error_message(r.status, text)}"
                    return None
                cards = json.loads(text).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            self.engine = f"unreachable ({e.__class__.__name__}: {e})"
            return None
        self.engine = "ready"
        return {c["id"]: c.get("root") or "" for c in cards if isinstance(c, dict) and c.get("parent")}

    async def _post(self, route: str, body: dict[str, Any], timeout: float) -> tuple[int, str]:
        import aiohttp

        try:
            async with self.session.post(f"{self.engine_url}{route}", json=body, headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, f"{e.__class__.__name__}: {e}"

    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.managed)))
        tmp.replace(self.state_file)

    # ---- one pass --------------------------------------------------------------------------------------------
    def _read_config(self) -> tuple[str, dict[str, str]] | None:
        try:
            raw = self.config.read_bytes()
            entries = json.loads(raw).get("adapters") or []
            return hashlib.sha256(raw).hexdigest()[:16], {e["name"]: e["source"] for e in entries}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            logger.warning("cannot read the adapter list %s: %s", self.config, e)
            return None

    def _resolve(self, a: Adapter) -> str | None:
        """The adapter's local directory, starting its download first if it comes from the hub (None meanwhile)."""
        if a.path is not None:
            return a.path
        if parse_source(a.source) is None:
            a.path = a.source
            return a.path
        if a.download is None:
            if time.monotonic() < a.retry_at:
                return None
            a.state, a.message = "Downloading", None
            a.download = asyncio.get_running_loop().create_task(asyncio.to_thread(fetch, a.source))
            return None
        if not a.download.done():
            return None
        task, a.download = a.download, None
        try:
            a.path = task.result()
        except Exception as e:  # the hub client's many failures (404, 401, offline, disk full)
            self._failed(a, f"cannot fetch {a.source}: {e.__class__.__name__}: {str(e).splitlines()[0][:500]}")
            return None
        return a.path

    def _failed(self, a: Adapter, message: str, refused_path: str | None = None) -> None:
        a.state, a.message, a.refused = "Failed", message, refused_path
        a.failures += 1
        a.retry_at = time.monotonic() + min(MAX_BACKOFF, self.interval * 2 ** a.failures)
        logger.warning("adapter %s: %s", a.name, message)

    async def sync_once(self) -> None:
        self.heartbeat = time.monotonic()
        read = self._read_config()
        if read is None:
            return
        digest, desired = read
        loaded = await self._engine_adapters()
        if loaded is None:
            for a in self.adapters.values():
                if a.state not in FINAL:
                    a.message = f"waiting for the engine: {self.engine}"
            self._track(desired)
            return
        lost = [a.name for a in self.adapters.values() if a.state == "Loaded" and a.name not in loaded]
        if lost and self.settled_once:  # the engine restarted (its container, not the pod): not ready until reloaded
            logger.warning("the engine lost adapters %s (restarted?): loading them again before reporting ready",
                           ", ".join(sorted(lost)))
            self.settled_once = False
        for name in sorted(self.managed - set(desired)):  # removed from the list: unload what this loop loaded
            if name in loaded:
                status, text = await self._post("/v1/unload_lora_adapter", {"lora_name": name}, LOAD_TIMEOUT)
                if status != 200 and status != 404:
                    logger.warning("adapter %s: unload failed (%s); retrying", name, _error_message(status, text))
                    continue
                logger.info("adapter %s unloaded", name)
            self.managed.discard(name)
            self._save()
        self._track(desired)
        for a in self.adapters.values():
            await self._converge(a, loaded)
        self.applied = digest
        if all(a.state in FINAL for a in self.adapters.values()):
            self.settled_once = True

    def _track(self, desired: dict[str, str]) -> None:
        """Entries for the listed adapters (a changed source starts over)."""
        for name in list(self.adapters):
            if name not in desired or self.adapters[name].source != desired[name]:
                old = self.adapters.pop(name)
                if old.download is not None:
                    old.download.cancel()
        for name, source in desired.items():
            self.adapters.setdefault(name, Adapter(name, source))

    async def _converge(self, a: Adapter, loaded: dict[str, str]) -> None:
        path = self._resolve(a)
        if path is None:
            return
        root = loaded.get(a.name)
        if root == path:
            if a.state != "Loaded":
                logger.info("adapter %s loaded from %s", a.name, path)
            a.state, a.message, a.failures = "Loaded", None, 0
            self.managed.add(a.name)
            return
        if a.refused == path or (a.state == "Failed" and time.monotonic() < a.retry_at):
            return
        if root is not None:  # loaded from another source before: replace it, if it is ours to replace
            if a.name not in self.managed:
                self._failed(a, f"the engine already serves an adapter named {a.name!r} (from {root}) that this "
                                "pod's list did not load (--lora-modules?)", refused_path=path)
                return
            status, text = await self._post("/v1/unload_lora_adapter", {"lora_name": a.name}, LOAD_TIMEOUT)
            if status not in (200, 404):
                self._failed(a, f"cannot unload the previous version: {_error_message(status, text)}")
                return
        a.state, a.message = "Loading", None
        status, text = await self._post("/v1/load_lora_adapter", {"lora_name": a.name, "lora_path": path},
                                        LOAD_TIMEOUT)
        if status == 200:
            a.state, a.message, a.failures = "Loaded", None, 0
            self.managed.add(a.name)
            self._save()
            logger.info("adapter %s loaded from %s", a.name, path)
        elif 400 <= status < 500 and status not in (408, 429):
            self._failed(a, _error_message(status, text), refused_path=path)
        else:
            self._failed(a, f"load failed, will retry: {_error_message(status, text) if status else text}")

    def status(self) -> dict[str, Any]:
        return {"config": self.applied, "engine": self.engine, "worker": self.worker,
                "adapters": [a.report() for a in sorted(self.adapters.values(), key=lambda a: a.name)]}

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()
        try:
            while not stop.is_set():
                if not self.worker:
                    try:
                        await self.sync_once()
                    except Exception:  # a bug must not stop the loop: log it and try again next pass
                        logger.exception("adapter sync pass failed")
                self.heartbeat = time.monotonic()
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            for a in self.adapters.values():
                if a.download is not None:
                    a.download.cancel()
            await self.session.close()


def make_app(syncer: Syncer):
    from aiohttp import web

    async def readyz(_request):
        ok = syncer.worker or syncer.settled_once
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def livez(_request):
        stale = time.monotonic() - syncer.heartbeat > max(60.0, 10 * syncer.interval) + LOAD_TIMEOUT
        return web.json_response({"alive": not stale}, status=503 if stale else 200)

    async def status(_request):
        return web.json_response(syncer.status())

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/status", status)
    return app


async def _serve(args: argparse.Namespace) -> None:
    import signal
    import tempfile

    from aiohttp import web

    state = Path(args.state_file or Path(tempfile.gettempdir()) / "shoal-adapter-sync.json")
    syncer = Syncer(Path(args.config), args.engine_url.rstrip("/"), state, interval=args.interval,
                    worker=os.environ.get("SHOAL_NODE_RANK", "0") != "0")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(make_app(syncer), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.info("adapter sync: %s -> %s, status on %s:%d", args.config, args.engine_url, args.host, args.port)
    try:
        await syncer.run(stop)
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0
