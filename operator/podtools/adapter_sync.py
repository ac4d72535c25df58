"""`shoal-podtools sync-adapters`: the in-pod loop that keeps an engine's LoRA adapters equal to a list.

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

Storage: hub adapters are fetched at most DOWNLOADS at a time, each after a random wait of up to --download-jitter
seconds (the pods of a fleet see a list change within the same refresh: their fetches are spread), and the snapshots this loop fetched that no listed
adapter uses any more (removed, or replaced by another revision) are deleted with their blobs after each pass.
An adapter whose adapter_config.json names another base model than the list's `baseModel` is refused unloaded.

/status (JSON) reports the list it applied (the sha256 of the file, which the operator compares with the
ConfigMap it rendered) and each adapter's state: the operator reads it from every serving pod into
status.adapters. Ranks > 0 of a multi-pod replica serve no API: there the loop only answers its probes.
No torch: the sidecar is small, and runs from the operator image next to any runtime's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
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
PARALLEL_LOADS = 4  # adapters converging at once: a pass of many slow loads is not their sum
DOWNLOADS = 2  # hub downloads at once per pod: a long list is fetched a few adapters at a time, not all at once
LIVENESS_SLACK = 60.0  # beyond one load's timeout, how old the heartbeat may grow before /livez fails


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the adapter list (the mounted ConfigMap's adapters.json)")
    parser.add_argument("--engine-url", default="http://127.0.0.1:8000", help="the engine in this pod")
    parser.add_argument("--host", default="0.0.0.0", help="bind address of /readyz, /livez and /status")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between passes")
    parser.add_argument("--keep-unused-snapshots", action="store_true",
                        help="never delete the hub snapshots of adapters the list no longer uses (a cache volume "
                             "other pods share, whose lists may still use them)")
    parser.add_argument("--download-jitter", type=float, default=5.0,
                        help="seconds (at most, at random) each hub download waits before it starts, so the pods "
                             "of a fleet do not all hit the hub at the same moment after a list change")
    parser.add_argument("--max-cache-bytes", type=int, default=0,
                        help="start no hub download once the pod's Hugging Face cache holds this many bytes (the "
                             "operator passes a share of the cache volume's size limit; 0: no cap)")
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

    from shoal.operator.podtools.download import PATTERNS, with_retries

    repo, revision = parse_source(source)
    return with_retries(lambda: snapshot_download(repo, revision=revision, allow_patterns=PATTERNS), source,
                        max_retries=5, backoff=2.0)


def cache_usage() -> int:
    """Bytes in this pod's Hugging Face cache (each blob once: snapshots are symlinks to blobs) and its model cache
    (the hf:// model the init container fetched, podtools/modelcache.py)."""
    from huggingface_hub import constants

    from shoal.operator.podtools.download import default_cache_dir

    total = 0
    for root, _dirs, files in (*os.walk(constants.HF_HUB_CACHE), *os.walk(default_cache_dir())):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += 0 if (st.st_mode & 0o170000) == 0o120000 else st.st_size  # symlinks count nothing
    return total


def drop_snapshot(path: str) -> bool:
    """Delete a hub snapshot this loop fetched (`.../models--org--name/snapshots/<commit>`) with the blobs no other
    revision of that repo shares (huggingface_hub's own cache deletion): removed adapters and replaced revisions
    do not pile up in the pod's cache volume. -> whether it was found and deleted."""
    from huggingface_hub import scan_cache_dir

    snapshot = Path(path)
    repo_dir = snapshot.parent.parent
    if snapshot.parent.name != "snapshots" or not repo_dir.parent.is_dir():
        return False
    cache = scan_cache_dir(repo_dir.parent)
    for repo in cache.repos:
        if Path(repo.repo_path) == repo_dir and any(r.commit_hash == snapshot.name for r in repo.revisions):
            cache.delete_revisions(snapshot.name).execute()
            return True
    return False


def _error_message(status: int, text: str) -> str:
    """An engine's error answer in one line: OpenAI's {"error": {"message"}}, vLLM's {"message"}, or the text."""
    try:
        body = json.loads(text)
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = inner.get("message") or text
    except (ValueError, AttributeError):
        message = text
    return f"{status}: {str(message).strip()[:1000]}"


def other_base_model(path: str, base_model: str | None) -> str | None:
    """Why the adapter at `path` was trained for another base model than the service's, or None (the same, or
    either unknown: no adapter_config.json, a local path as its base, a model given as a path). An adapter of
    another model with the same shapes would load silently and answer nonsense."""
    try:
        trained_on = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not base_model or not isinstance(trained_on, str) or not trained_on.strip():
        return None
    trained_on = trained_on.strip().rstrip("/")
    if trained_on.startswith(("/", ".", "~")):  # a path on the trainer's machine: no hub id to compare
        return None
    if trained_on.lower() == base_model.strip().rstrip("/").lower():
        return None
    return (f"trained for base model {trained_on} (adapter_config.json base_model_name_or_path), but this service "
            f"serves {base_model}: not loaded")


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
    base_model: str | None = None  # the service's model as a hub id (the list's baseModel), when known
    collect: bool = True  # delete the snapshots this loop fetched that the list no longer uses
    max_cache_bytes: int = 0  # no hub download starts once the cache holds this much (0: no cap)
    jitter: float = 0.0  # seconds (at most, at random) before each hub download starts
    fetched: set[str] = field(default_factory=set)  # hub snapshots this loop downloaded (persisted in state_file)
    downloads: Any = None  # asyncio.Semaphore(DOWNLOADS)

    def __post_init__(self) -> None:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError, TypeError):
            state = []
        if isinstance(state, list):  # the format before snapshots were tracked: the loaded names only
            state = {"managed": state}
        self.managed = set(state.get("managed") or [])
        self.fetched = set(state.get("fetched") or [])
        self.downloads = asyncio.Semaphore(DOWNLOADS)

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
        tmp.write_text(json.dumps({"managed": sorted(self.managed), "fetched": sorted(self.fetched)}))
        tmp.replace(self.state_file)

    def _collect(self) -> None:
        """Delete the snapshots this loop fetched that no listed adapter uses any more (removed, or replaced by
        another revision)."""
        wanted = {a.path for a in self.adapters.values() if a.path}
        for path in sorted(self.fetched - wanted) if self.collect else ():
            try:
                deleted = drop_snapshot(path)
            except Exception as e:  # a cache another process changed meanwhile: try again next pass
                logger.warning("cannot delete the unused adapter snapshot %s: %s", path, e)
                continue
            if deleted:
                logger.info("deleted the unused adapter snapshot %s", path)
            self.fetched.discard(path)
            self._save()

    # ---- one pass --------------------------------------------------------------------------------------------
    def _read_config(self) -> tuple[str, dict[str, str]] | None:
        try:
            raw = self.config.read_bytes()
            body = json.loads(raw)
            entries = body.get("adapters") or []
            self.base_model = body.get("baseModel") or None
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
            used = cache_usage() if self.max_cache_bytes else 0
            if self.max_cache_bytes and used >= self.max_cache_bytes:  # retried: removed adapters free space
                self._failed(a, f"not downloaded: the pod's cache holds {used / 2**30:.1f} GiB, at its cap of "
                                f"{self.max_cache_bytes / 2**30:.1f} GiB (a share of the cache volume's size; "
                                "remove adapters or raise spec.model.cache.size)")
                return None
            a.state, a.message = "Downloading", None
            a.download = asyncio.get_running_loop().create_task(self._fetch(a.source))
            return None
        if not a.download.done():
            return None
        task, a.download = a.download, None
        try:
            a.path = task.result()
        except Exception as e:  # the hub client's many failures (404, 401, offline, disk full)
            self._failed(a, f"cannot fetch {a.source}: {e.__class__.__name__}: {str(e).splitlines()[0][:500]}")
            return None
        self.fetched.add(a.path)
        self._save()
        return a.path

    async def _fetch(self, source: str) -> str:
        """One hub download, at most DOWNLOADS at once in this pod."""
        if self.downloads is None:
            self.downloads = asyncio.Semaphore(DOWNLOADS)
        if self.jitter > 0:  # a list change reaches every pod within the same kubelet refresh: spread the fetches
            await asyncio.sleep(random.uniform(0.0, self.jitter))
        async with self.downloads:
            return await asyncio.to_thread(fetch, source)

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
        # A few at a time, each beating the heart when it starts and ends: /livez fails only when one adapter's
        # load is stuck past its timeout, never because a pass of many slow loads is long (a liveness failure of
        # this container would restart it mid-pass, and the pass would start over).
        gate = asyncio.Semaphore(PARALLEL_LOADS)

        async def converge(a: Adapter) -> None:
            async with gate:
                self.heartbeat = time.monotonic()
                await self._converge(a, loaded)
                self.heartbeat = time.monotonic()
        await asyncio.gather(*(converge(a) for a in list(self.adapters.values())))
        self._collect()
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
        mismatch = other_base_model(path, self.base_model)
        if mismatch:
            self._failed(a, mismatch, refused_path=path)
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
        stale = time.monotonic() - syncer.heartbeat > max(LIVENESS_SLACK, 10 * syncer.interval) + LOAD_TIMEOUT
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
                    collect=not args.keep_unused_snapshots, max_cache_bytes=args.max_cache_bytes,
                    jitter=args.download_jitter,
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
