"""`shoal-podtools`: download | cache-lease | sync-adapters — the engine pods' helper containers (operator image, any runtime)."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Sequence

from shoal.operator.podtools import adapter_sync, download, lease


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal-podtools", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    dl = sub.add_parser("download", help="fetch a hub model into the model cache (the pod's init container)",
                        description=download.__doc__.splitlines()[0])
    download.add_args(dl)
    dl.set_defaults(func=download.run)
    ls = sub.add_parser("cache-lease", help="keep the pod's lease on its model cache entry (the pod's sidecar)",
                        description=lease.__doc__.splitlines()[0])
    lease.add_args(ls)
    ls.set_defaults(func=lease.run)
    sync = sub.add_parser("sync-adapters", help="keep a running engine's LoRA adapters equal to a list (the pod's "
                          "sidecar)", description=adapter_sync.__doc__.splitlines()[0])
    adapter_sync.add_args(sync)
    sync.set_defaults(func=adapter_sync.run)
    return parser


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The operator image has no init: this process is PID 1, for which the kernel ignores an unhandled SIGTERM
    # (a deleted pod would wait out its grace period). The adapter sync installs its own graceful handler.
    signal.signal(signal.SIGTERM, _terminated)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
