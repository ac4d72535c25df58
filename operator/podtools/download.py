"""`shoal-podtools download`: fetch a hub model into the pod's model cache, before the engine starts.

The engine itself never touches the network; in Kubernetes this runs as the pod's init container for
`hf://` models, from the operator image (any runtime: Shoal's engine, vLLM, SGLang) (HF_HOME points at the pod's cache volume, which may be a persistent claim shared by every pod;
HF_TOKEN, if set, authorises gated models). Only what the engine loads is fetched: config, safetensors shards and
their index, tokenizer and generation files (and, for a repository without config.json, i.e. llama.cpp's, its one
GGUF file; several are refused by name).

Downloads are resumable: the hub client keeps partial files (``*.incomplete``) and continues them, so a pod
restarted mid-download, or a second pod sharing the cache, does not start over; files already in the cache are
not fetched again. A transient failure (a connection error, 408/429/5xx from the hub) is retried here with
exponential backoff (honouring Retry-After), resuming where it stopped, so a hub hiccup never restarts the
container — which, for a multi-pod group, would have looked like a failed rank; 401/403/404, offline mode or a
full disk fail at once. Progress is logged as plain lines (``kubectl logs POD -c model-download``), not as terminal
progress bars.

The model lands in the model cache (modelcache.py, ``$SHOAL_CACHE/models/<org>--<name>@<revision>``), which the
engine loads as a plain folder: under the entry's lock (a second pod, or another service on the same claim, waits
and then finds it cached), checked against its manifest at each start (sizes, and the sha256 of every file rewritten or replaced
since the entry was committed, as its mtime tells; `--verify full` hashes every file: a corrupt entry is fetched
again), downloaded into a partial folder, every file checked against the hub's ETag (sha256 for LFS
files, the git blob sha1 otherwise), and renamed into place whole. Room is made under the cache's size cap by
evicting least recently used entries no running pod leases; a model that cannot fit fails with the reason. The
pod's lease is taken before this exits (the `cache-lease` sidecar then keeps it fresh), and a one-line JSON summary
(the entry, and what the whole cache holds: its ten most recently used entries) goes to the termination message,
which the operator copies into status.modelCache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from shoal.operator.podtools.modelcache import VERIFY_MODES, CacheError, ModelCache, entry_key

T = TypeVar("T")
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]  # + *.gguf
# for a repository without config.json (llama.cpp's: one GGUF file holds config, tokenizer and weights)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hub id, e.g. Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--progress-interval", type=float, default=30.0,
                        help="seconds between progress lines in the log (default: 30)")
    parser.add_argument("--max-retries", type=_count, default=10,
                        help="retries of a transient hub failure (connection, 408/429/5xx) before giving up "
                             "(default: 10)")
    parser.add_argument("--retry-backoff", type=_seconds, default=2.0,
                        help="first retry delay in seconds, doubled per retry up to 120 (default: 2)")
    add_cache_args(parser)
    parser.add_argument("--max-cache-bytes", type=_count, default=None,
                        help="the cache's size cap: least recently used entries no pod leases are evicted to fit "
                             "the model under it (default: no cap)")
    parser.add_argument("--verify", choices=VERIFY_MODES, default="stat",
                        help="how a cached entry is checked at start: the sha256 of every file whose mtime changed "
                             "since the entry was committed, and every size (stat, the default: an untouched "
                             "entry of any size in milliseconds); every file's sha256 (full); only the sizes")
    parser.add_argument("--termination-log", default="/dev/termination-log",
                        help="where the JSON summary goes (the pod's termination message; skipped if not writable)")


def default_cache_dir() -> str:
    base = os.environ.get("SHOAL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shoal")
    return os.path.join(base, "models")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None,
                        help="the model cache's root (default: $SHOAL_CACHE/models)")
    parser.add_argument("--holder", default=os.environ.get("HOSTNAME") or os.uname().nodename,
                        help="who leases the entry (default: the pod's name, $HOSTNAME)")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def transient(e: BaseException) -> float | None:
    """Is this failure worth retrying? -> the server's Retry-After in seconds (0 when it gave none), or None when
    retrying cannot help (401/403/404, offline mode, disk full, a bug)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    if constants.HF_HUB_OFFLINE:  # the client refuses the network itself (OfflineModeIsEnabled, a ConnectionError)
        return None
    for cause in _chain(e):
        if isinstance(cause, HfHubHTTPError):
            response = getattr(cause, "response", None)
            status = getattr(response, "status_code", None)
            if status not in TRANSIENT_STATUSES:
                return None
            try:
                return max(0.0, float(response.headers.get("Retry-After", 0)))
            except (TypeError, ValueError):
                return 0.0
        if isinstance(cause, (HTTPError, ConnectionError, TimeoutError)):  # the request never got an answer
            return 0.0
    return None


def with_retries(fetch: Callable[[], T], what: str, max_retries: int, backoff: float,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """fetch(), retried on transient failures with exponential backoff and jitter (Retry-After when longer)."""
    for attempt in range(max_retries + 1):
        try:
            return fetch()
        except Exception as e:
            wait = transient(e)
            if wait is None or attempt == max_retries:
                raise
            delay = max(wait, min(120.0, backoff * 2 ** attempt) * random.uniform(0.8, 1.2))
            print(f"fetching {what}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                  f"retry {attempt + 1}/{max_retries} in {delay:.1f}s (partial files are kept)", flush=True)
            sleep(delay)
    raise AssertionError("unreachable")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class Progress:
    """Measures the bytes of a download folder (the hub client's partial files included) against the total."""

    def __init__(self, folder: Path, total: int | None):
        self.folder, self.total = folder, total
        self.t0, self.start = time.monotonic(), self.on_disk()

    def on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file()) if self.folder.is_dir() else 0

    def line(self) -> str:
        have = self.on_disk()
        rate = (have - self.start) / max(time.monotonic() - self.t0, 1e-9)
        of = f" of {_gib(self.total)} ({100 * have / self.total:.1f}%)" if self.total else ""
        return f"downloading: {_gib(have)}{of}, {rate / 2**20:.1f} MiB/s"

    def report_every(self, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            print(self.line(), flush=True)


def run(args: argparse.Namespace) -> int:
    where = f"{args.model!r}{' at ' + args.revision if args.revision else ''}"
    try:
        cache = ModelCache(args.cache_dir or default_cache_dir())
        summary = ensure(cache, args, where)
    except CacheError as e:
        print(f"shoal-podtools download: {where}: {e}", file=sys.stderr)
        _terminate_with(args.termination_log, f"model cache: {e}")
        return 1
    except Exception as e:  # the hub client raises many types (offline, 401/404, disk full): all are fatal here
        print(f"shoal-podtools download: cannot fetch {where}: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 1
    _terminate_with(args.termination_log, summary_message(summary))
    return 0


MESSAGE_LIMIT = 4000  # of the termination message that is kept (_terminate_with): the JSON must fit whole


def summary_message(summary: dict) -> str:
    """The summary as the termination message's JSON, the cache's listing shortened (least recently used entries
    first) until it fits: a cut JSON would be no summary at all."""
    recent = list((summary.get("cache") or {}).get("recent") or [])
    while True:
        shown = {**summary, "cache": {**summary["cache"], "recent": recent}} if "cache" in summary else summary
        text = json.dumps({"modelCache": shown}, separators=(",", ":"))
        if len(text) <= MESSAGE_LIMIT or not recent:
            return text
        recent.pop()


def ensure(cache: ModelCache, args: argparse.Namespace, where: str) -> dict:
    """The model's cache entry, verified, leased by this pod: found, repaired or downloaded -> the summary."""
    key = entry_key(args.model, args.revision)
    t0 = time.perf_counter()
    with cache.lock(key, on_wait=lambda: print(f"waiting: another pod is fetching {where} into the cache",
                                               flush=True)):
        fetched, evicted = False, []
        cache.lease(key, args.holder)  # first: an eviction for another model skips it while it is checked
        manifest = cache.manifest(key)
        if manifest is not None:
            problems = cache.verify(key, args.verify)
            if problems:
                print(f"cached {where} is corrupt ({'; '.join(problems[:3])}): fetching it again", flush=True)
                cache.discard(key)
                manifest = None
        if manifest is None:
            manifest, evicted = _download(cache, key, args, where)
            fetched = True
        cache.touch(key)
        cache.lease(key, args.holder)  # refreshed: it lasts until the lease sidecar (or the engine's start) takes over
    verb = "downloaded" if fetched else "found in the cache (verified)"
    print(f"{verb}: {where} at {cache.path(key)}, {_gib(manifest['sizeBytes'])}, {time.perf_counter() - t0:.1f}s"
          + (f"; evicted {', '.join(evicted)}" if evicted else ""), flush=True)
    inventory = cache.inventory()  # what the whole cache holds now, for status.modelCache
    if args.max_cache_bytes is not None:
        inventory["capBytes"] = args.max_cache_bytes
    return {"entry": key, "commit": manifest.get("commit"), "sizeBytes": manifest["sizeBytes"],
            "verified": manifest.get("verified"), "fetched": fetched, "evicted": evicted[:5], "cache": inventory}


def _download(cache: ModelCache, key: str, args: argparse.Namespace, where: str) -> tuple[dict, list[str]]:
    from huggingface_hub import snapshot_download  # (imported only to fetch: a cached entry starts without it)
    from huggingface_hub._local_folder import read_download_metadata
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # plain progress lines in the log (Progress), no terminal bars

    patterns = PATTERNS
    plan = with_retries(lambda: snapshot_download(args.model, revision=args.revision, allow_patterns=patterns,
                                                  dry_run=True), where, args.max_retries, args.retry_backoff)
    if not any(f.filename == "config.json" for f in plan):  # a llama.cpp repository: the engine serves its GGUF
        patterns = [*PATTERNS, "*.gguf"]
        plan = with_retries(lambda: snapshot_download(args.model, revision=args.revision, allow_patterns=patterns,
                                                      dry_run=True), where, args.max_retries, args.retry_backoff)
        ggufs = sorted(f.filename for f in plan if f.filename.endswith(".gguf"))
        if len(ggufs) > 1:  # several quantizations of one model: fetching them all would be a mistake
            raise CacheError(f"the repository has no config.json and {len(ggufs)} GGUF files "
                             f"({', '.join(ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}); the engine serves "
                             "one GGUF file per model: publish it alone in a repository, or serve it by file://")
    total = sum(f.file_size or 0 for f in plan)
    evicted = cache.make_room(key, total, args.max_cache_bytes)
    partial = cache.partial(key)
    partial.mkdir(parents=True, exist_ok=True)
    print(f"fetching {where}: {len(plan)} files, {_gib(total)}, {_gib(Progress(partial, None).on_disk())} "
          "already downloaded", flush=True)
    stop = threading.Event()
    progress = Progress(partial, total or None)
    threading.Thread(target=progress.report_every, args=(args.progress_interval, stop), daemon=True).start()
    try:
        with_retries(lambda: snapshot_download(args.model, revision=args.revision, allow_patterns=patterns,
                                               local_dir=partial), where, args.max_retries, args.retry_backoff)
    except BaseException:
        cache.unreserve(key)  # the partial files stay (a retry resumes them), the promise of space does not
        raise
    finally:
        stop.set()
    etags, commit = {}, None
    for f in plan:
        meta = read_download_metadata(partial, f.filename)
        etags[f.filename] = meta.etag if meta else None
        commit = commit or (meta.commit_hash if meta else None)
    source = {"source": f"hf://{args.model}", "revision": args.revision or "main", "commit": commit}
    return cache.commit(key, source, etags), evicted


def _terminate_with(path: str, message: str) -> None:
    """The pod's termination message (at most 4 KiB is kept): the operator reads the summary from it."""
    try:
        with open(path, "w") as f:
            f.write(message[:MESSAGE_LIMIT])
    except OSError:
        pass
