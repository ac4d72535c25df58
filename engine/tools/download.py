"""`shoal-engine download`: fetch a hub model into the local Hugging Face cache, before the engine starts.

The engine itself never touches the network; in Kubernetes this runs as the pod's init container for
`hf://` models (HF_HOME points at the pod's cache volume, which may be a persistent claim shared by every pod;
HF_TOKEN, if set, authorises gated models). Only what the engine loads is fetched: config, safetensors shards and
their index, tokenizer and generation files.

Downloads are resumable: the hub client keeps partial files (``*.incomplete``) and continues them, so a pod
restarted mid-download, or a second pod sharing the cache, does not start over; files already in the cache are
not fetched again. Progress is logged as plain lines (``kubectl logs POD -c model-download``), not as terminal
progress bars.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hub id, e.g. Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--progress-interval", type=float, default=30.0,
                        help="seconds between progress lines in the log (default: 30)")


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
        plan = snapshot_download(args.model, revision=args.revision, allow_patterns=PATTERNS, dry_run=True)
        total = sum(f.file_size or 0 for f in plan)
        cached = sum(f.file_size or 0 for f in plan if f.is_cached)
        print(f"fetching {where}: {len(plan)} files, {_gib(total)}, {_gib(cached)} already in the cache",
              flush=True)
        folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=args.model, repo_type="model")
        progress = Progress(folder, total or None)
        threading.Thread(target=progress.report_every, args=(args.progress_interval, stop), daemon=True).start()
        path = snapshot_download(args.model, revision=args.revision, allow_patterns=PATTERNS)
    except Exception as e:  # the hub client raises many types (offline, 401/404, disk full): all are fatal here
        print(f"shoal-engine download: cannot fetch {where}: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        stop.set()
    print(f"downloaded {args.model} to {path} in {time.perf_counter() - t0:.1f}s")
    return 0
