"""`shoal-podtools download`: fetch a hub model into the local Hugging Face cache, before the engine starts.

The engine itself never touches the network; in Kubernetes this runs as the pod's init container for
`hf://` models, from the operator image (any runtime: Shoal's engine, vLLM, SGLang) (HF_HOME points at the pod's cache volume, which may be a persistent claim shared by every pod;
HF_TOKEN, if set, authorises gated models). Only what the engine loads is fetched: config, safetensors shards and
their index, tokenizer and generation files.

Downloads are resumable: the hub client keeps partial files (``*.incomplete``) and continues them, so a pod
restarted mid-download, or a second pod sharing the cache, does not start over; files already in the cache are
not fetched again. A transient failure (a connection error, 408/429/5xx from the hub) is retried here with
exponential backoff (honouring Retry-After), resuming where it stopped, so a hub hiccup never restarts the
container — which, for a multi-pod group, would have looked like a failed rank; 401/403/404, offline mode or a
full disk fail at once. Progress is logged as plain lines (``kubectl logs POD -c model-download``), not as terminal
progress bars.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


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
    """Measures the bytes of a model's cache folder (partial files included) against the total to fetch."""

    def __init__(self, folder: Path, total: int | None):
        self.folder, self.total = folder, total
        self.t0, self.start = time.monotonic(), self.on_disk()

    def on_disk(self) -> int:
        blobs = self.folder / "blobs"
        return sum(f.stat().st_size for f in blobs.iterdir() if f.is_file()) if blobs.is_dir() else 0

    def line(self) -> str:
        have = self.on_disk()
        rate = (have - self.start) / max(time.monotonic() - self.t0, 1e-9)
        of = f" of {_gib(self.total)} ({100 * have / self.total:.1f}%)" if self.total else ""
        return f"downloading: {_gib(have)}{of}, {rate / 2**20:.1f} MiB/s"

    def report_every(self, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            print(self.line(), flush=True)


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    t0 = time.perf_counter()
    where = f"{args.model!r}{' at ' + args.revision if args.revision else ''}"
    stop = threading.Event()
    try:
        plan = with_retries(lambda: snapshot_download(args.model, revision=args.revision, allow_patterns=PATTERNS,
                                                      dry_run=True), where, args.max_retries, args.retry_backoff)
        total = sum(f.file_size or 0 for f in plan)
        cached = sum(f.file_size or 0 for f in plan if f.is_cached)
        print(f"fetching {where}: {len(plan)} files, {_gib(total)}, {_gib(cached)} already in the cache",
              flush=True)
        folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=args.model, repo_type="model")
        progress = Progress(folder, total or None)
        threading.Thread(target=progress.report_every, args=(args.progress_interval, stop), daemon=True).start()
        path = with_retries(lambda: snapshot_download(args.model, revision=args.revision, allow_patterns=PATTERNS),
                            where, args.max_retries, args.retry_backoff)
    except Exception as e:  # the hub client raises many types (offline, 401/404, disk full): all are fatal here
        print(f"shoal-podtools download: cannot fetch {where}: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        stop.set()
    print(f"downloaded {args.model} to {path} in {time.perf_counter() - t0:.1f}s")
    return 0
