"""What each engine's prefix cache holds, from its KV events (vLLM's wire format; kv_subscriber.py feeds it).

One KVIndex per pool: the engines of one InferenceService (one model), so a request is only ever scored against
the blocks of engines that serve its own model; blocks stored under a LoRA adapter hash from the adapter's own
root (shoal.engine.kv_hash.lora_root of the engine's adapter id) and never match a base-model prompt. An engine
numbers its adapters itself, so the index learns each engine's name -> id from its BlockStored events (lora_id,
lora_name) and hashes an adapter request's prompt per engine from that engine's root; an engine that never
stored a block under the adapter holds none of its prefix. An engine's view is a set of block
hashes (with the medium each is in) that is kept only while its event stream is known to be complete: a sequence
gap, a restarted engine (sequence numbers from 0 again), a dropped connection or an AllBlocksCleared empties it,
so the index holds no block an engine may have lost without saying so (it may miss some: that costs a cache hit,
a stale entry would cost a prefill on the wrong engine).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import msgpack

from shoal.engine.kv_hash import BASE_ROOT, hash_chain, lora_root

log = logging.getLogger("shoal.gateway.kv")


@dataclass
class EngineView:
    blocks: dict[int | bytes, str | None] = field(default_factory=dict)  # block hash -> medium
    last_seq: int = -1  # the last batch applied (-1: none since the last reset)
    events: int = 0  # events applied since the engine was first seen
    resets: int = 0
    lora_ids: dict[str, int] = field(default_factory=dict)  # adapter name -> this engine's adapter id


def decode_batch(payload: bytes) -> list[tuple]:
    """An EventBatch payload as (kind, fields...) tuples: ("BlockStored", hashes, parent, tokens, block_size,
    lora_id, medium, lora_name), ("BlockRemoved", hashes, medium), ("AllBlocksCleared",). Both of vLLM's encodings are read:
    array-like structs (a tag, then the fields in order) and maps (the tag under "type")."""
    batch = msgpack.unpackb(payload, strict_map_key=False)
    events = batch.get("events", []) if isinstance(batch, dict) else batch[1]
    out = []
    for e in events:
        if isinstance(e, dict):
            kind = e.get("type")
            if kind == "BlockStored":
                out.append((kind, e["block_hashes"], e.get("parent_block_hash"), e.get("token_ids", []),
                            e.get("block_size"), e.get("lora_id"), e.get("medium"), e.get("lora_name")))
            elif kind == "BlockRemoved":
                out.append((kind, e["block_hashes"], e.get("medium")))
            elif kind == "AllBlocksCleared":
                out.append((kind,))
        elif isinstance(e, list) and e:
            kind = e[0]
            if kind == "BlockStored":
                padded = list(e[1:8]) + [None] * (7 - len(e[1:8]))
                out.append((kind, *padded))
            elif kind == "BlockRemoved":
                out.append((kind, e[1], e[2] if len(e) > 2 else None))
            elif kind == "AllBlocksCleared":
                out.append((kind,))
    return out


class KVIndex:
    def __init__(self, max_blocks: int = 512):
        self.views: dict[str, EngineView] = {}
        self.block_size: int | None = None  # the engines' KV block size, from their BlockStored events
        self.max_blocks = max_blocks  # hash at most this many leading blocks of a prompt

    def view(self, url: str) -> EngineView:
        view = self.views.get(url)
        if view is None:
            view = self.views[url] = EngineView()
        return view

    def reset(self, url: str, reason: str) -> None:
        """Forget what `url` holds: its stream is no longer known to be complete."""
        view = self.view(url)
        if view.blocks or view.last_seq >= 0:
            log.info("KV index: %s's view reset (%s; %d blocks forgotten)", url, reason, len(view.blocks))
        view.blocks.clear()
        view.last_seq = -1
        view.resets += 1

    def drop(self, url: str) -> None:
        self.views.pop(url, None)

    def apply(self, url: str, seq: int, events: Iterable[tuple]) -> None:
        view = self.view(url)
        blocks = view.blocks
        for e in events:
            kind = e[0]
            if kind == "BlockStored":
                _, hashes, _, _, block_size, lora_id, medium, lora_name = e
                if block_size:
                    self.block_size = block_size
                if lora_id is not None and lora_name:
                    view.lora_ids[lora_name] = lora_id
                for h in hashes:
                    blocks[h] = medium
            elif kind == "BlockRemoved":
                for h in e[1]:
                    blocks.pop(h, None)
            elif kind == "AllBlocksCleared":
                blocks.clear()
            view.events += 1
        view.last_seq = seq

    def prompt_hashes(self, tokens: Sequence[int] | None, root: int = BASE_ROOT) -> list[int]:
        """The engines' block hashes of a prompt's leading full blocks from chain root `root` (none before any
        engine reported its block size, or without tokens)."""
        if not tokens or not self.block_size:
            return []
        return list(islice(hash_chain(tokens, self.block_size, parent=root), self.max_blocks))

    def matches(self, urls: Iterable[str], tokens: Sequence[int] | None, adapter: str | None = None
                ) -> dict[str, int]:
        """Engine URL -> the number of leading blocks of the prompt `tokens` it holds, under LoRA adapter
        `adapter` (None: the base model); engines holding none are left out."""
        chains: dict[int, list[int]] = {}  # root -> the prompt's hashes from it (one per adapter id)
        out = {}
        for url in urls:
            view = self.views.get(url)
            if view is None or not view.blocks:
                continue
            if adapter is None:
                root = BASE_ROOT
            elif adapter in view.lora_ids:
                root = lora_root(view.lora_ids[adapter])
            else:
                continue  # this engine never cached a block under the adapter
            hashes = chains.get(root)
            if hashes is None:
                hashes = chains[root] = self.prompt_hashes(tokens, root)
            n = 0
            for h in hashes:
                if h not in view.blocks:
                    break
                n += 1
            if n:
                out[url] = n
        return out
