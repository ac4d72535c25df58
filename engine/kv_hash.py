"""The prefix cache's block hashes: the one definition the engine keys its KV blocks by and publishes in its KV
events, and that a router recomputes from a prompt's token ids to know which engine holds which prefix.

Standard library only (the gateway imports it without torch). The definition, for consumers in other languages:

    hash(block) = first 8 bytes, big-endian unsigned, of
                  sha256( parent as 8 bytes big-endian | tokens as 4-byte little-endian unsigned ints )

where `parent` is the previous block's hash and, for a sequence's first block, the chain's root: 0 for the base
model, and for a LoRA adapter `lora_root(lora_id)` = the same digest of sha256(b"shoal-lora" | lora_id as 8
bytes big-endian) (the engine's adapter id, published as BlockStored.lora_id), so equal tokens under different
adapters never share a block. Equal hashes mean equal prefixes (to 64 bits); Python's salted `hash()` would not
be reproducible in another process. Hashing is ~1 µs per 16-token block, off no critical path that matters.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from functools import lru_cache

BASE_ROOT = 0  # the parent of a base-model sequence's first block


def lora_root(lora_id: int | None) -> int:
    """The parent of a sequence's first block under LoRA adapter `lora_id` (None: the base model)."""
    if lora_id is None:
        return BASE_ROOT
    return int.from_bytes(hashlib.sha256(b"shoal-lora" + lora_id.to_bytes(8, "big")).digest()[:8], "big")


@lru_cache(maxsize=16)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")  # n token ids, 4-byte little-endian


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(8, "big") + _packer(len(tokens)).pack(*tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def hash_chain(token_ids: Sequence[int], block_size: int, start_block: int = 0, parent: int = BASE_ROOT
               ) -> Iterator[int]:
    """Hashes of the full blocks of token_ids from block `start_block` on, each chained to the previous one
    (`parent`: the hash of block start_block - 1, or the chain's root at the start)."""
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        yield parent
