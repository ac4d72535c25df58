"""`shoal-podtools cache-lease`: keep this pod's lease on its model cache entry fresh while the pod runs.

A native sidecar (an init container with restartPolicy Always) of pods on a shared cache: the download init
container took the lease; this refreshes it every tenth of its lifetime, so the cache's eviction never removes a
model a running pod uses, and releases it on SIGTERM (pod deletion). A pod that dies without releasing loses its
lease when it expires (modelcache.LEASE_TTL).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from shoal.operator.podtools.modelcache import LEASE_TTL, ModelCache, entry_key


def add_args(parser: argparse.ArgumentParser) -> None:
    from shoal.operator.podtools.download import add_cache_args

    parser.add_argument("--model", required=True, help="hub id of the entry, as given to download")
    parser.add_argument("--revision", default=None)
    add_cache_args(parser)


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    from shoal.operator.podtools.download import default_cache_dir

    cache = ModelCache(args.cache_dir or default_cache_dir())
    key = entry_key(args.model, args.revision)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"leasing {key} as {args.holder} (refreshed every {LEASE_TTL / 10:.0f}s)", flush=True)
    try:
        while True:
            try:
                cache.lease(key, args.holder)
            except OSError as e:  # a volume hiccup: the lease outlives several missed refreshes
                print(f"lease refresh failed: {e}", file=sys.stderr, flush=True)
            if stop.wait(LEASE_TTL / 10):
                break
    finally:
        cache.release(key, args.holder)
        print(f"released {key}", flush=True)
    return 0
