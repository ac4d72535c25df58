"""`shoal-podtools`: download | cache-lease | sync-adapters — the engine pods' helper containers (operator image, any runtime)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Sequence

# name -> (its module in shoal.operator.podtools: add_args(parser) and run(args), the help line). A command's module
# is imported only when that command runs (or for the full --help): the model-download init container runs before
# every engine start, and the adapter sidecar's asyncio alone cost it ~40 ms.
COMMANDS = {
    "download": ("download", "fetch a hub model into the model cache (the pod's init container)"),
    "cache-lease": ("lease", "keep the pod's lease on its model cache entry (the pod's sidecar)"),
    "sync-adapters": ("adapter_sync", "keep a running engine's LoRA adapters equal to a list (the pod's sidecar)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's flags, or only `command`'s (the others listed by name and help)."""
    parser = argparse.ArgumentParser(prog="shoal-podtools", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_line) in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_line)
            continue
        module = importlib.import_module(f"shoal.operator.podtools.{module_name}")
        p = sub.add_parser(name, help=help_line, description=module.__doc__.splitlines()[0])
        module.add_args(p)
        p.set_defaults(func=module.run)
    return parser


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    # The operator image has no init: this process is PID 1, for which the kernel ignores an unhandled SIGTERM
    # (a deleted pod would wait out its grace period). The adapter sync installs its own graceful handler.
    signal.signal(signal.SIGTERM, _terminated)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
