"""The prefix cache's block hashes: the one definition the engine keys its KV blocks by and publishes in its KV
events, and that a router recomputes from a prompt's token ids to know which engine holds which prefix.

Standard library only (the gateway imports it without torch). The definition, for consumers in other languages:

    hash(block) = first 8 bytes, big-endian unsigned, of
                  sha256( parent as 8 bytes big-endian | tokens as 4-byte little-endian unsigned ints )

where `parent` is the previous block's hash and, for a sequence's first block, the chain's root: 0 for the base
model, and for a LoRA adapter `lora_root(lora_id)` = the same digest of sha256(b"shoal-lora" | lora_id as 8
bytes big-endian) (the engine's adapter id, published as BlockStored.lora_id), so equal tokens under different
adapters never share a block. Equal hashes mean equal prefixes (to 64 bits); Python's salted `hash()` would not
be reproducible in another process.

A block that holds image tokens (a vision-language prompt) appends its extra key to the digested bytes:

    sha256( parent | tokens | extra )

where `extra` is b"shoal-image" followed by the 32-byte content digest of each image whose tokens the block holds
(in prompt order): the same text with a different image never shares a block, the same image does. Text-only
blocks have no extra key, so their hashes are unchanged. KV events publish a block's image digests (hex) as its
BlockStored `extra_keys` entry (vLLM's field), and a router with a prompt's image placements (offset, token count,
digest: the engine's /tokenize answers them) recomputes the same keys (`image_block_key`). Hashing is ~1 µs per
16-token block, off no critical path that matters.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
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


def block_hash(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    data = parent.to_bytes(8, "big") + _packer(len(tokens)).pack(*tokens) + extra
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


IMAGE_KEY = b"shoal-image"


def image_key(digests: Sequence[bytes]) -> bytes:
    """A block's extra key from the 32-byte digests of the images with tokens in it (b"" for none)."""
    return IMAGE_KEY + b"".join(digests) if digests else b""


def image_block_key(images: Sequence[tuple[int, int, bytes]], block_size: int, block: int) -> bytes:
    """Block `block`'s extra key for a prompt whose images are (offset of the first token, token count, digest),
    in prompt order: image_key of every image with a token in the block."""
    start, end = block * block_size, (block + 1) * block_size
    return image_key([d for offset, n, d in images if offset < end and start < offset + n])


def event_extra_keys(extra: bytes) -> list[str] | None:
    """A block's extra key as its KV event's `extra_keys` entry: its image digests in hex, None for none."""
    if not extra:
        return None
    body = extra[len(IMAGE_KEY):]
    return [body[i:i + 32].hex() for i in range(0, len(body), 32)]


def extra_from_event(keys: Sequence | None) -> bytes | None:
    """The inverse of event_extra_keys: the extra key an event's `extra_keys` entry stands for (b"" for none), or
    None when the entry is not a list of 32-byte hex digests (another runtime's keys: not hashable here)."""
    if not keys:
        return b""
    try:
        digests = [bytes.fromhex(k) for k in keys]
    except (TypeError, ValueError):
        return None
    return image_key(digests) if all(len(d) == 32 for d in digests) else None


def hash_chain(token_ids: Sequence[int], block_size: int, start_block: int = 0, parent: int = BASE_ROOT,
               extra_keys: Callable[[int], bytes] | None = None) -> Iterator[int]:
    """Hashes of the full blocks of token_ids from block `start_block` on, each chained to the previous one
    (`parent`: the hash of block start_block - 1, or the chain's root at the start). `extra_keys(i)`: block i's
    extra key (b"" for none), for prompts with images."""
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        extra = extra_keys(start // block_size) if extra_keys is not None else b""
        parent = block_hash(parent, token_ids[start:start + block_size], extra)
        yield parent
