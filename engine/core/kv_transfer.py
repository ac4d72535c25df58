"""Prefill/decode disaggregation: a prompt's KV blocks from the engine that prefilled it (the producer) to the
engine that decodes it (the consumer), keyed by the prefix cache's block hashes (kv_hash.py).

The request flow is vLLM's `kv_transfer_params`, what llm-d's and Dynamo's routers send:
1. The router sends the request to a producer with kv_transfer_params {"do_remote_decode": true} (and max_tokens
   1). The producer prefills it like any request, so its blocks are in its prefix cache, and answers with
   kv_transfer_params {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", ...}.
2. The router sends the request to a consumer with those kv_transfer_params. Before the consumer schedules it,
   its server asks the producer (POST /kv_transfer/pull) for the full prompt blocks it does not hold, by hash, and
   keeps them in its first offload tier. The scheduler's prefix lookup then reads them into the pool as it reads
   any offloaded block (core/kv_tiers.py), so only the prompt's last block is computed there.
The producer holds the prompt's blocks for the consumer: once a prefill finishes, its full blocks are referenced
(kept out of eviction) until the pull that names the hold (`remote_request_id`) has taken them, or for at most
`kv_connector_extra_config.hold_seconds` (default 30 s, vLLM's NIXL keeps them until a timeout as well). Holds
never cost a request its turn: they take at most half the pool (the oldest go first), and a step that could
schedule nothing while requests wait lets go of all of them. A block
the producer no longer has is simply not sent, and the consumer computes what it did not get. A pull that fails
(the producer unreachable, slow, or of another layout) falls back to a local prefill: the answer is the same,
only slower.

Blocks are only moved between engines of one layout: the fingerprint (same weights, dtype, KV dtype, block size,
quantization and per-rank block bytes) must match, or the producer refuses the pull with the field that differs.
Equal hashes then mean equal KV bytes, so the consumer's output equals a local prefill's.

The wire (the pull's response body): 4 bytes big-endian header length, the JSON header {"block_hashes": [...],
"block_nbytes": N, "digest": blake2b-128 hex of the blocks}, then the blocks' bytes back to back (each block every
rank's shard in rank order, as the executors export them).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import uuid
from pathlib import Path

PULL_PATH = "/kv_transfer/pull"
_HEADER = struct.Struct(">I")


class TransferError(Exception):
    """A pull that cannot be used; `reason` is its label in shoal:kv_transfer_fallbacks_total."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def model_identity(model_dir: Path) -> str:
    """Which weights: the config's bytes and the weight files' names and sizes (a cheap stand-in for hashing
    gigabytes; a re-trained checkpoint of one architecture differs in its files' sizes or config only rarely,
    which is why operators serve one model per InferenceService)."""
    h = hashlib.sha256()
    path = Path(model_dir)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in
                                                 (".json", ".safetensors", ".gguf", ".bin"))
    for f in files:
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        if f.name == "config.json":
            h.update(f.read_bytes())
    return h.hexdigest()[:32]


class KVTransfer:
    """The engine's side (its calls run on the engine's thread, between steps): what a pull may take from this
    engine's KV cache and tiers, and where pulled blocks go."""

    def __init__(self, engine):
        c = engine.config
        self.config = c.kv_transfer_config
        why = ("an encoder-only model keeps no KV cache" if engine.is_encoder else
               "a hybrid model's prefix needs its recurrent state too, which is not transferred" if engine.state_bytes
               else None)
        if why:
            raise ValueError(f"--kv-transfer-config: {why}")
        self.engine = engine
        self.engine_id = self.config.engine_id or f"shoal-{uuid.uuid4().hex[:12]}"
        self.rank_nbytes = list(engine.executor.kv_rank_nbytes())
        self.fingerprint = {
            "model": model_identity(engine.model_dir), "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": c.kv_cache_dtype, "block_size": c.block_size, "quantization": c.quantization or "none",
            "tensor_parallel_size": c.tensor_parallel_size, "pipeline_parallel_size": c.pipeline_parallel_size,
            "rank_block_nbytes": self.rank_nbytes,
        }
        self.served_blocks = 0
        self._holds: dict[str, tuple[list[int], float]] = {}  # hold id -> (block ids referenced, until when)

    @property
    def block_nbytes(self) -> int:
        return sum(self.rank_nbytes)

    def mismatch(self, theirs: dict) -> str | None:
        """The first fingerprint field in which another engine differs from this one, as a message (None: same)."""
        for key, mine in self.fingerprint.items():
            if theirs.get(key) != mine:
                return f"{key}: this engine has {mine!r}, the other {theirs.get(key)!r}"
        return None

    def held(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` this engine holds already (its pool's prefix cache, then its tiers)."""
        pool, n = self.engine.pool, 0
        while n < len(hashes) and pool.cached_block(hashes[n]) is not None:
            n += 1
        tiers = self.engine.tiers
        if n < len(hashes) and tiers is not None:
            n += len(self.engine.executor.kv_lookup(hashes[n:]))
        return n

    def export(self, hashes: list[int], hold_id: str | None = None) -> list[bytes]:
        """The leading blocks of `hashes` this engine can give (from its pool, else its offload tiers), each as
        every rank's bytes; the hold `hold_id` (the prefill's) is let go once they are copied."""
        self.expire()
        try:
            return self._export(hashes)
        finally:
            self.release(hold_id)

    def _export(self, hashes: list[int]) -> list[bytes]:
        pool, pairs = self.engine.pool, []
        for h in hashes:
            block_id = pool.cached_block(h)
            if block_id is None and self.engine.tiers is None:
                break
            pairs.append((h, -1 if block_id is None else block_id))
        blobs = self.engine.executor.kv_export(pairs) if pairs else []
        self.served_blocks += len(blobs)
        return blobs

    def hold(self, hashes: list[int]) -> str | None:
        """Keep the cached blocks of `hashes` out of eviction for a consumer's pull; the hold's id (None: nothing
        cached to hold)."""
        self.expire()
        ids = self.engine.pool.reference_cached(hashes)
        if not ids:
            return None
        hold_id = uuid.uuid4().hex
        self._holds[hold_id] = (ids, time.monotonic() + self.config.hold_seconds)
        while self.held_blocks > self.engine.pool.num_blocks // 2:  # at most half the pool: the oldest go first
            self.release(next(iter(self._holds)))
        return hold_id if hold_id in self._holds else None

    def release(self, hold_id: str | None) -> None:
        entry = self._holds.pop(hold_id, None) if hold_id else None
        if entry is not None:
            self.engine.pool.free(entry[0])

    def expire(self) -> None:
        """Let go of the holds no pull came for in time."""
        now = time.monotonic()
        for hold_id in [h for h, (_, until) in self._holds.items() if until <= now]:
            self.release(hold_id)

    def release_all(self) -> None:
        """Every hold let go (a prefix-cache reset, sleep: the blocks' contents are to be forgotten)."""
        for hold_id in list(self._holds):
            self.release(hold_id)

    @property
    def held_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self._holds.values())

    def import_blocks(self, hashes: list[int], blobs: list[bytes]) -> None:
        """Keep pulled blocks in the first offload tier, where the request's prefix lookup finds them."""
        bad = next((len(b) for b in blobs if len(b) != self.block_nbytes), None)
        if bad is not None:
            raise TransferError("incompatible", f"a pulled block has {bad} bytes, this engine's {self.block_nbytes}")
        self.engine.executor.kv_import(list(zip(hashes, blobs)))


def encode_blocks(hashes: list[int], blobs: list[bytes]) -> bytes:
    body = b"".join(blobs)
    header = json.dumps({"block_hashes": [str(h) for h in hashes[:len(blobs)]],
                         "block_nbytes": len(blobs[0]) if blobs else 0,
                         "digest": hashlib.blake2b(body, digest_size=16).hexdigest()}).encode()
    return _HEADER.pack(len(header)) + header + body


def decode_blocks(payload: bytes, asked: list[int], block_nbytes: int) -> list[bytes]:
    """The blocks of a pull's response, checked: they must be a prefix of what was asked, of this engine's block
    size, and arrive whole (the digest)."""
    try:
        (n,) = _HEADER.unpack_from(payload)
        header = json.loads(payload[4:4 + n])
        hashes = [int(h) for h in header["block_hashes"]]
        size = int(header["block_nbytes"])
        digest = header["digest"]
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise TransferError("malformed", f"the producer's answer is not a KV transfer payload ({e})") from None
    body = payload[4 + n:]
    if hashes != asked[:len(hashes)]:
        raise TransferError("malformed", "the producer sent blocks that were not asked for")
    if hashes and size != block_nbytes:
        raise TransferError("incompatible", f"the producer's blocks have {size} bytes, this engine's {block_nbytes}")
    if len(body) != size * len(hashes) or hashlib.blake2b(body, digest_size=16).hexdigest() != digest:
        raise TransferError("corrupted", f"the producer's {len(hashes)} block(s) arrived damaged or truncated "
                                         f"({len(body)} bytes)")
    return [body[i * size:(i + 1) * size] for i in range(len(hashes))]
