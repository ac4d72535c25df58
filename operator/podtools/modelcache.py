"""The model cache on the pods' /cache volume: complete, verified model folders shared by every pod (and every
service) that mounts the same claim.

Layout under the cache root (``$SHOAL_CACHE/models``)::

    <key>/                   a complete entry: the model's files and, written last, .shoal-entry.json
    .partial/<key>/          a download in progress (only its entry's lock holder writes it; resumable)
    .partial/<key>.bytes     what that download will take (counted against the cap while it runs)
    .locks/<key>.lock        one flock per model+revision: concurrent pods wait instead of downloading twice
    .locks/.cache.lock       held while space is made (eviction) so two evictions never race
    .leases/<key>/<holder>   one file per pod using the entry, refreshed (mtime) while the pod runs
    .trash/                  entries being deleted (renamed there first, so nobody ever sees half of one)

An entry appears by one rename of its finished, verified download folder: a reader sees all of it or nothing,
and the manifest inside (file sizes and sha256, written before the rename) is the "complete" marker. Eviction is
LRU (the entry's ``.last-used`` mtime, touched by every pod that starts on it) under the cache's size cap, and
never removes an entry with a live lease. flock works on local disks and on NFSv4 (lockd for v3); a filesystem
without locks fails the download with a clear error rather than racing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

MANIFEST = ".shoal-entry.json"
LAST_USED = ".last-used"
LEASE_TTL = 600.0  # seconds a lease lives without a refresh (the lease sidecar refreshes every LEASE_TTL / 10)
_CHUNK = 8 << 20
VERIFY_MODES = ("full", "stat", "size")  # ModelCache.verify


class CacheError(RuntimeError):
    """The cache cannot hold or serve the entry; the message says why (and what to change)."""


def entry_key(repo: str, revision: str | None) -> str:
    """`org/name` at `revision` -> the entry's folder name (render/ passes the same path to the engine)."""
    return repo.replace("/", "--") + "@" + urllib.parse.quote(revision or "main", safe="")


def file_digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file in one read: the hub's ETag is the first for LFS files, the second for
    plain git files."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def file_sha256(path: Path) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
    return sha256.hexdigest()


def _hash_all(root: Path, names: list[str], threads: int, digest: Callable[[Path], object] = file_digests) -> dict:
    # hashlib releases the GIL on large buffers: shards hash in parallel, as fast as the volume reads
    with ThreadPoolExecutor(max(1, min(threads, len(names) or 1))) as pool:
        return dict(zip(names, pool.map(lambda n: digest(root / n), names)))


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


@dataclass
class Entry:
    key: str
    size: int
    last_used: float
    leases: list[str]
    manifest: dict


class ModelCache:
    def __init__(self, root: Path | str, lease_ttl: float = LEASE_TTL, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.lease_ttl = lease_ttl
        self.clock = clock
        for sub in (".partial", ".locks", ".leases", ".trash"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def partial(self, key: str) -> Path:
        return self.root / ".partial" / key

    # ---- locks -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _flock(self, name: str, on_wait: Callable[[], None] | None) -> Iterator[None]:
        with open(self.root / ".locks" / name, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise CacheError(f"{self.root}: the cache volume does not support file locks ({e}); "
                                     "concurrent pods could not share it safely") from None
                if on_wait:
                    on_wait()
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def lock(self, key: str, on_wait: Callable[[], None] | None = None):
        """Exclusive use of one entry (check, download, re-fetch): a second pod waits, then finds it cached."""
        return self._flock(f"{key}.lock", on_wait)

    def space_lock(self):
        return self._flock(".cache.lock", None)

    # ---- entries -----------------------------------------------------------------------------------------------
    def manifest(self, key: str) -> dict | None:
        """The entry's manifest; None when the entry is absent (a folder without one is never an entry)."""
        try:
            return json.loads((self.path(key) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def verify(self, key: str, mode: str = "full", threads: int = 4) -> list[str]:
        """What is wrong with the entry against its manifest: [] when it is intact. Every mode finds missing and
        resized files; `full` also hashes every file; `stat` hashes only the files whose mtime is not the one
        recorded at the commit (rewritten or replaced since: a changed byte is written by something), so an
        untouched entry of any size is checked in milliseconds, and every file of an entry committed before
        mtimes were recorded; `size` hashes nothing."""
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
        manifest = self.manifest(key)
        if manifest is None:
            return ["no manifest"]
        root, files = self.path(key), manifest.get("files") or {}
        problems, to_hash = [], []
        for name, meta in files.items():
            try:
                st = (root / name).stat()
            except OSError:
                problems.append(f"{name}: missing")
                continue
            if st.st_size != meta["size"]:
                problems.append(f"{name}: {st.st_size} bytes, expected {meta['size']}")
            elif mode == "full" or (mode == "stat" and meta.get("mtimeNs") != st.st_mtime_ns):
                to_hash.append(name)
        if to_hash and not problems:
            for name, sha256 in _hash_all(root, to_hash, threads, file_sha256).items():
                if sha256 != files[name]["sha256"]:
                    problems.append(f"{name}: sha256 {sha256[:12]}..., expected {files[name]['sha256'][:12]}...")
        return problems

    def commit(self, key: str, source: dict, expected: dict[str, str | None], threads: int = 4) -> dict:
        """Verify the finished download in .partial/<key> (every file's digest against `expected`: the hub's ETag,
        a sha256 or a git blob sha1; None: nothing to check it against), write its manifest, then rename it into
        place. A mismatch discards the download and raises."""
        partial = self.partial(key)
        names = sorted(str(p.relative_to(partial)) for p in partial.rglob("*")
                       if p.is_file() and ".cache" not in p.relative_to(partial).parts)
        missing = sorted(set(expected) - set(names))
        if missing:
            raise CacheError(f"download of {key} is incomplete: {', '.join(missing[:5])} missing")
        digests = _hash_all(partial, names, threads)
        bad = [n for n, etag in expected.items()
               if etag and etag.strip('"').lower() not in digests[n]]
        if bad:
            self._trash(partial)
            raise CacheError(f"download of {key} does not match the hub's checksums: {', '.join(bad[:5])} "
                             "(discarded; the next attempt fetches it again)")
        shutil.rmtree(partial / ".cache", ignore_errors=True)  # the hub client's resume metadata
        stats = {n: (partial / n).stat() for n in names}  # a rename keeps them: `stat` verification compares mtimes
        files = {n: {"size": stats[n].st_size, "sha256": digests[n][0], "mtimeNs": stats[n].st_mtime_ns}
                 for n in names}
        manifest = {**source, "files": files, "sizeBytes": sum(f["size"] for f in files.values()),
                    "verified": "hub" if any(expected.values()) else "manifest", "created": self.clock()}
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        (partial / LAST_USED).touch()
        if self.path(key).exists():  # a corrupt entry the caller decided to replace (under the lock)
            self._trash(self.path(key))
        os.rename(partial, self.path(key))  # the commit: the whole entry appears at once
        self.unreserve(key)
        _fsync_dir(self.root)
        return manifest

    def unreserve(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / ".partial" / f"{key}.bytes").unlink()

    def discard(self, key: str) -> None:
        """Remove an entry (corrupt, or evicted): renamed away first, so no pod ever opens half of it."""
        if self.path(key).exists():
            self._trash(self.path(key))

    def _trash(self, path: Path) -> None:
        target = self.root / ".trash" / f"{path.name}.{os.getpid()}.{time.monotonic_ns()}"
        os.rename(path, target)
        shutil.rmtree(target, ignore_errors=True)  # open files stay readable by their pods until closed

    def touch(self, key: str) -> None:
        """This entry was just used: the LRU order."""
        (self.path(key) / LAST_USED).touch()

    # ---- leases ------------------------------------------------------------------------------------------------
    def lease(self, key: str, holder: str) -> None:
        """Take or refresh `holder`'s lease on the entry (a refresh is a new mtime)."""
        folder = self.root / ".leases" / key
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / _safe(holder)
        path.touch()
        now = self.clock()
        os.utime(path, (now, now))

    def release(self, key: str, holder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / ".leases" / key / _safe(holder)).unlink()

    def leases(self, key: str) -> list[str]:
        """Holders whose lease is live; expired leases (a pod that died without releasing) are removed."""
        folder, live = self.root / ".leases" / key, []
        now = self.clock()
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime <= self.lease_ttl:
                    live.append(path.name)
                else:
                    path.unlink()
        return live

    # ---- space -------------------------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            manifest = self.manifest(path.name)
            if manifest is None:
                continue
            try:
                last_used = (path / LAST_USED).stat().st_mtime
            except OSError:
                last_used = manifest.get("created", 0.0)
            out.append(Entry(path.name, manifest.get("sizeBytes", 0), last_used, self.leases(path.name), manifest))
        return sorted(out, key=lambda e: e.last_used)

    def inventory(self, limit: int = 10) -> dict:
        """What the cache holds, for the status: the entry count and bytes, and the `limit` most recently used
        entries (size, last use as UTC ISO 8601, live leases)."""
        found = self.entries()
        recent = sorted(found, key=lambda e: e.last_used, reverse=True)[:limit]
        return {"entries": len(found), "usedBytes": sum(e.size for e in found),
                "recent": [{"entry": e.key, "sizeBytes": e.size, "leases": len(e.leases),
                            "lastUsed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.last_used))}
                           for e in recent]}

    def usage(self, exclude: str | None = None) -> int:
        """Bytes the cache holds or has promised: entries, and each download folder at its reserved full size
        (a running download) or its size on disk (an abandoned one)."""
        total = sum(e.size for e in self.entries() if e.key != exclude)
        for key, reserved, on_disk in self._partials():
            if key != exclude:
                total += max(reserved, on_disk)
        return total

    def _partials(self) -> list[tuple[str, int, int]]:
        """(key, reserved bytes, bytes on disk) of every download folder or reservation."""
        found: dict[str, list[int]] = {}
        for path in (self.root / ".partial").iterdir():
            if path.name.endswith(".bytes"):
                with contextlib.suppress(OSError, ValueError):
                    found.setdefault(path.name[:-len(".bytes")], [0, 0])[0] = int(path.read_text())
            elif path.is_dir():
                found.setdefault(path.name, [0, 0])[1] = folder_bytes(path)
        return [(k, r, d) for k, (r, d) in found.items()]

    def _drop_abandoned(self, keep: str) -> None:
        """Delete download folders nobody is downloading (their entry's lock is free): a model whose download
        failed for good, or was replaced, must not hold space forever. The trash is emptied too."""
        for key, _reserved, _on_disk in self._partials():
            if key == keep:
                continue
            with open(self.root / ".locks" / f"{key}.lock", "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a download in progress
                try:
                    shutil.rmtree(self.partial(key), ignore_errors=True)
                    self.unreserve(key)
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        for leftover in (self.root / ".trash").iterdir():  # a deletion a crash interrupted
            shutil.rmtree(leftover, ignore_errors=True)

    def make_room(self, key: str, need: int, cap: int | None) -> list[str]:
        """Reserve `need` bytes for downloading `key` under `cap`, evicting least recently used entries nobody
        leases; -> the evicted keys. Raises CacheError (evicting nothing) when it cannot fit."""
        if cap is not None and need > cap:
            raise CacheError(f"{key} needs {_gib(need)} but the model cache holds at most {_gib(cap)} "
                             "(raise spec.model.cache.size)")
        with self.space_lock():
            evict: list[Entry] = []
            if cap is not None:
                if cap - self.usage(exclude=key) < need:
                    self._drop_abandoned(keep=key)
                free = cap - self.usage(exclude=key)
                for entry in self.entries():
                    if free >= need:
                        break
                    if entry.key != key and not entry.leases:
                        evict.append(entry)
                        free += entry.size
                if free < need:
                    in_use = [f"{e.key} ({_gib(e.size)}, leased by {', '.join(e.leases[:3])})"
                              for e in self.entries() if e.leases]
                    raise CacheError(f"{key} needs {_gib(need)}; the model cache ({_gib(cap)}) has "
                                     f"{_gib(max(free, 0))} free after evicting every unused entry; in use: "
                                     f"{'; '.join(in_use[:5]) or 'none'}")
            for entry in evict:
                self.discard(entry.key)
            _write_atomic(self.root / ".partial" / f"{key}.bytes", str(need))
            return [e.key for e in evict]


def _safe(holder: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", holder)[:200] or "_"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
