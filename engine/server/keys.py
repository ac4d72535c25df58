"""The API keys an engine accepts: one (--api-key, $SHOAL_API_KEY) or the lines of a file (--api-key-file), re-read
when the file changes, so a rotated Kubernetes Secret (mounted as a volume: the kubelet swaps it in place) takes
effect without restarting the engine. During a rollover the Secret holds the new key and the old one, one per line
(newest first); every line is accepted. Keys are compared as SHA-256 digests in constant time per key."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

log = logging.getLogger("shoal.server.keys")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip()]
    if not keys:
        raise ValueError(f"API key file {path} is empty")
    return keys


class KeySet:
    def __init__(self, keys: list[str], path: str | None = None, reload_interval: float = 1.0):
        self.path = path
        self.reload_interval = reload_interval
        self._digests = [_digest(k) for k in keys]
        self._checked = time.monotonic()
        self._stamp = self._stat()

    @classmethod
    def from_file(cls, path: str, reload_interval: float = 1.0) -> "KeySet":
        return cls(read_keys(path), path, reload_interval)

    def _stat(self) -> tuple | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)  # follows the Secret volume's ..data symlink
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < self.reload_interval:
            return
        self._checked = now
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return
        try:
            keys = read_keys(self.path)
        except (OSError, ValueError) as e:  # a half-written or emptied file: keep the keys read before
            log.warning("cannot re-read %s (keeping the keys read before): %s", self.path, e)
            return
        self._stamp = stamp
        self._digests = [_digest(k) for k in keys]
        log.info("API keys re-read from %s: %d key(s)", self.path, len(keys))

    def accepts(self, token: str) -> bool:
        if not token:
            return False
        self._maybe_reload()
        given = _digest(token)
        return any([hmac.compare_digest(given, d) for d in self._digests])  # every key compared, always
