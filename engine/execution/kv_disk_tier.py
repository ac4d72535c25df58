"""The local-disk tier: KV blocks pushed out of the CPU tier, one file per block, each with a checksum.

A file is a 64-byte header (magic, the payload's length, its BLAKE2b-256 digest) followed by the block's bytes. It
is written to a temporary name and renamed, so a reader never sees half a file from this process; a file damaged
or cut short on disk anyway fails its length or digest check on load, is deleted and reported missing, so the
engine recomputes the block instead of serving it.

The tier does not survive a restart: at start the engine deletes what an earlier run left in its directory (a
rank's own subdirectory, rank-<n>), since nothing records which model, weights or block size wrote it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import torch

from shoal.engine.execution.kv_connector import LRUTier

logger = logging.getLogger(__name__)

MAGIC = b"SHOALKV1"
HEADER = struct.Struct("<8sQ32s16x")  # magic, payload bytes, digest, padding to 64 bytes
SUFFIX = ".kvblock"


def digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier(LRUTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_blocks: int, block_nbytes: int):
        super().__init__(capacity_blocks, block_nbytes)  # _blocks: the hashes on disk (-> None)
        self.directory = Path(directory)
        self.corrupted = 0  # blocks found damaged on load (and recomputed)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            stale = [p for p in self.directory.iterdir() if p.suffix in (SUFFIX, ".tmp")]
            for p in stale:
                p.unlink()
        except OSError as e:
            raise ValueError(f"--kv-offloading-disk-path: cannot use {self.directory}: {e}") from None
        if stale:
            logger.info("KV disk tier: discarded %d block file(s) an earlier run left in %s", len(stale),
                        self.directory)

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}{SUFFIX}"

    def _evict(self, block_hash: int, kept: object) -> None:
        self._unlink(self._path(block_hash))

    def _put(self, block_hash: int, data: torch.Tensor) -> None:
        payload = data.contiguous().numpy().tobytes()
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, len(payload), digest(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:  # a full or failing disk loses this block only: it is recomputed when needed
            logger.warning("KV disk tier: could not write a block to %s: %s", path, e)
            self._unlink(tmp)
            return
        self._blocks[block_hash] = None

    def load(self, block_hash: int) -> torch.Tensor | None:
        if block_hash not in self._blocks:
            return None
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError as e:
            return self._damaged(block_hash, f"unreadable ({e})")
        if len(raw) < HEADER.size:
            return self._damaged(block_hash, f"truncated to {len(raw)} bytes")
        magic, length, want = HEADER.unpack_from(raw)
        payload = memoryview(raw)[HEADER.size:]
        if magic != MAGIC or length != self.block_nbytes or len(payload) != length:
            return self._damaged(block_hash, f"{len(payload)} payload bytes where {self.block_nbytes} belong")
        if digest(payload) != want:
            return self._damaged(block_hash, "checksum mismatch")
        self._blocks.move_to_end(block_hash)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _damaged(self, block_hash: int, why: str) -> None:
        self.corrupted += 1
        logger.warning("KV disk tier: block %016x is damaged (%s): dropped, it will be recomputed", block_hash, why)
        self.remove(block_hash)
        return None

    def _discard(self, block_hash: int, kept: object) -> None:
        self._unlink(self._path(block_hash))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("KV disk tier: could not delete %s: %s", path, e)
