"""`shoal-engine download`: fetch a hub model into the local Hugging Face cache, before the engine starts.

The engine itself never touches the network; in Kubernetes this runs as the pod's init container for
`hf://` models (HF_HOME points at the pod's cache volume; HF_TOKEN, if set, authorises gated models).
Only what the engine loads is fetched: config, safetensors shards and their index, tokenizer and
generation files.
"""

from __future__ import annotations

import argparse
import sys
import time

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hub id, e.g. Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download

    t0 = time.perf_counter()
    try:
        path = snapshot_download(args.model, revision=args.revision, allow_patterns=PATTERNS)
    except Exception as e:  # the hub client raises many types (offline, 401/404, disk full): all are fatal here
        print(f"shoal-engine download: cannot fetch {args.model!r}"
              f"{' at ' + args.revision if args.revision else ''}: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 1
    print(f"downloaded {args.model} to {path} in {time.perf_counter() - t0:.1f}s")
    return 0
