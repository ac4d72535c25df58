"""What each engine's prefix cache holds, from its KV events (vLLM's wire format; kv_subscriber.py feeds it).

The index keys every block by the gateway's own hash of its token-id chain (shoal.engine.kv_hash, from the chain's
root, the parent block's own hash and the block's token_ids as BlockStored carries them), whatever hash the engine
reported: a Shoal engine reports exactly that hash, a vLLM engine reports its own (seeded per process, so no other
process can recompute it). So a prompt is hashed one way for both runtimes, and each view maps the reported hashes
to the gateway's (BlockRemoved names only reported hashes). A block is counted once per copy the engine reports
(vLLM may cache one hash in two blocks, or in two tiers) and held while any copy is. A block the gateway cannot
hash is left out, and so is every block chained to it: its parent was never heard (the view started mid-stream),
its tokens are not the block's, or vLLM's extra keys (multimodal inputs, a cache_salt) went into its hash. A Shoal
engine's image block is hashed: its extra keys are the digests of its images (kv_hash.event_extra_keys), and a
prompt with images (kv_tokens.PromptTokens: the placements and digests the engine's /tokenize answers) hashes its image
blocks with the same digests, so the same image matches and another image under the same text does not. For an
engine that reports the gateway's own hashes (checked on the blocks it could hash) the reported hash is used as is
when its parent was never heard.

One KVIndex per pool: the engines of one InferenceService (one model), so a request is only ever scored against
the blocks of engines that serve its own model. Blocks stored under a LoRA adapter chain from the adapter's own
root (kv_hash.lora_root of the engine's adapter id, or of its name when an engine reports only the name) and never
match a base-model prompt. An engine numbers its adapters itself, so each view learns the engine's adapter name ->
root from its BlockStored events (lora_id, lora_name) and an adapter request's prompt is hashed per engine from that
engine's root; an engine that never stored a block under the adapter holds none of its prefix. A view is kept only
while its event stream is known to be complete: a sequence gap, a restarted engine (sequence numbers from 0 again;
it may number its adapters anew), a dropped connection or an AllBlocksCleared empties it, so the index holds no
block an engine may have lost without saying so (it may miss some: that costs a cache hit, a stale entry would cost
a prefill on the wrong engine).

Tiers. Each copy is held in the `medium` its events name: the engine's KV cache (vLLM: "GPU"; Shoal: "GPU", or
"CPU" on a CPU engine) or an offload tier (vLLM's and Shoal's host-memory tier: "CPU", on a Shoal CPU engine
"CPU_OFFLOAD"; Shoal's disk tier: "DISK"), and BlockRemoved removes the copy in the medium it names, so a block
that left the KV cache for a tier stays held, in the tier. A view's device media are the ones it heard computed
blocks stored in (BlockStored with the block's token ids: a tier's BlockStored carries none, for both runtimes);
every other medium is a tier. An engine scores the blocks of the prompt's leading run it holds, each at the
weight of its best copy: 1 in the KV cache, TIER_WEIGHTS in a tier (a tier hit still saves the block's
prefill, at the cost of reading it back).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import msgpack

from shoal.engine.kv_hash import BASE_ROOT, block_hash, extra_from_event, hash_chain, image_block_key, lora_root

log = logging.getLogger("shoal.gateway.kv")

Reported = int | bytes  # an engine's block hash as it published it (vLLM: an int or 32 bytes)

# What a block held in an offload tier is worth against one in the KV cache (1): the prefill it saves minus the
# read back. From host memory that is a copy of the block's bytes (a PCIe transfer on a GPU, a memcpy on a CPU:
# bench_offload measured a CPU-tier hit at about half a recompute's TTFT on 2 cores, the pool's at nearly none);
# from disk a file read and a checksum on top. A tier hit must still beat a shorter hit in the KV cache only when
# it covers clearly more: 5 blocks from disk (2.5) lose to 3 in the KV cache, 7 (3.5) win.
TIER_WEIGHTS = {"CPU": 0.8, "CPU_OFFLOAD": 0.8, "DISK": 0.5}
OTHER_TIER_WEIGHT = 0.5  # a tier this gateway does not know (a shared store): as far as the disk


def named_lora_root(name: str) -> int:
    """The gateway's root for an adapter an engine names without an id (vLLM deprecates lora_id for lora_name)."""
    return int.from_bytes(hashlib.sha256(b"shoal-lora-name" + name.encode()).digest()[:8], "big")


@dataclass
class EngineView:
    blocks: dict[int, dict[str | None, int]] = field(default_factory=dict)  # own hash -> medium -> copies
    device_media: set = field(default_factory=set)  # the media computed blocks were stored in: the KV cache's
    reported: dict[Reported, list] = field(default_factory=dict)  # reported hash -> [own hash, copies]
    block_size: int | None = None  # the engine's KV block size, from its BlockStored events
    native: bool | None = None  # the engine reports the gateway's own hashes (a Shoal engine); None: not known yet
    last_seq: int = -1  # the last batch applied (-1: none since the last reset)
    events: int = 0  # events applied since the engine was first seen
    resets: int = 0
    lora_roots: dict[str, int] = field(default_factory=dict)  # adapter name -> its chain root on this engine

    def clear_blocks(self) -> None:
        self.blocks.clear()
        self.reported.clear()

    def media_blocks(self) -> dict[str, int]:
        """Medium -> blocks held there (a medium-less copy, older vLLM's, under "")."""
        out: dict[str, int] = {}
        for media in self.blocks.values():
            for m in media:
                out[m or ""] = out.get(m or "", 0) + 1
        return out

    def weight(self, own: int) -> float:
        """What the best copy of a held block is worth: 1 in the KV cache, less in an offload tier."""
        return max(1.0 if m in self.device_media or m is None else TIER_WEIGHTS.get(m, OTHER_TIER_WEIGHT)
                   for m in self.blocks[own])


def plain(extra_keys: Sequence | None, lora_name: str | None) -> bool:
    """Whether vLLM hashed a block from its tokens (and adapter) alone: no extra key but the adapter's name."""
    return not extra_keys or all(k == lora_name for k in extra_keys)


def block_extra(extra_keys: Sequence | None, lora_name: str | None) -> bytes | None:
    """The extra key the gateway hashes a block with: b"" for a plain block, a Shoal engine's image key for a block
    whose extra keys are image digests (kv_hash.extra_from_event), None for any other (not hashable here)."""
    if plain(extra_keys, lora_name):
        return b""
    return extra_from_event([k for k in extra_keys if k != lora_name])


def decode_batch(payload: bytes) -> list[tuple]:
    """An EventBatch payload as (kind, fields...) tuples: ("BlockStored", hashes, parent, tokens, block_size,
    lora_id, medium, lora_name, extra_keys), ("BlockRemoved", hashes, medium), ("AllBlocksCleared",). Both of
    vLLM's encodings are read: array-like structs (a tag, then the fields in order; older vLLM, and Shoal) and maps
    (the tag under "type"; vLLM since its events stopped being array-like). Fields a version lacks read None, and
    fields a newer one adds after these are ignored."""
    batch = msgpack.unpackb(payload, strict_map_key=False)
    events = batch.get("events", []) if isinstance(batch, dict) else batch[1]
    out = []
    for e in events:
        if isinstance(e, dict):
            kind = e.get("type")
            if kind == "BlockStored":
                out.append((kind, e["block_hashes"], e.get("parent_block_hash"), e.get("token_ids", []),
                            e.get("block_size"), e.get("lora_id"), e.get("medium"), e.get("lora_name"),
                            e.get("extra_keys")))
            elif kind == "BlockRemoved":
                out.append((kind, e["block_hashes"], e.get("medium")))
            elif kind == "AllBlocksCleared":
                out.append((kind,))
        elif isinstance(e, list) and e:
            kind = e[0]
            if kind == "BlockStored":
                fields = list(e[1:9])
                out.append((kind, *fields, *[None] * (8 - len(fields))))
            elif kind == "BlockRemoved":
                out.append((kind, e[1], e[2] if len(e) > 2 else None))
            elif kind == "AllBlocksCleared":
                out.append((kind,))
    return out


class KVIndex:
    def __init__(self, max_blocks: int = 512):
        self.views: dict[str, EngineView] = {}
        self.max_blocks = max_blocks  # hash at most this many leading blocks of a prompt

    def view(self, url: str) -> EngineView:
        view = self.views.get(url)
        if view is None:
            view = self.views[url] = EngineView()
        return view

    def reset(self, url: str, reason: str) -> None:
        """Forget what `url` holds: its stream is no longer known to be complete (a restarted engine may also
        number its adapters anew, so their roots go too)."""
        view = self.view(url)
        if view.blocks or view.last_seq >= 0:
            log.info("KV index: %s's view reset (%s; %d blocks forgotten)", url, reason, len(view.blocks))
        view.clear_blocks()
        view.lora_roots.clear()
        view.block_size = view.native = None
        view.device_media = set()
        view.last_seq = -1
        view.resets += 1

    def drop(self, url: str) -> None:
        self.views.pop(url, None)

    def apply(self, url: str, seq: int, events: Iterable[tuple]) -> None:
        view = self.view(url)
        for e in events:
            kind = e[0]
            if kind == "BlockStored":
                self._stored(url, view, *e[1:9], *[None] * (9 - len(e)))
            elif kind == "BlockRemoved":
                for h in e[1]:
                    self._release(view, h, e[2] if len(e) > 2 else None)
            elif kind == "AllBlocksCleared":
                view.clear_blocks()
            view.events += 1
        view.last_seq = seq

    def _stored(self, url: str, view: EngineView, hashes: list, parent: Reported | None, tokens: list | None,
                block_size: int | None, lora_id: int | None, medium: str | None, lora_name: str | None,
                extra_keys: list | None) -> None:
        if block_size:
            if view.block_size is None:
                view.block_size = block_size
            elif block_size != view.block_size:  # e.g. a hybrid model's second KV group: not this index's blocks
                return
        bs = view.block_size
        if lora_id is None and not lora_name:
            root = BASE_ROOT
        else:
            root = lora_root(lora_id) if lora_id is not None else named_lora_root(lora_name)
            if lora_name:
                view.lora_roots[lora_name] = root
        if parent is None:
            own_parent: int | None = root
        else:
            known = view.reported.get(parent)
            own_parent = known[0] if known is not None else None
        tokens = tokens or []
        whole = bool(bs) and len(tokens) == bs * len(hashes)
        if whole:
            view.device_media.add(medium)  # computed blocks: a tier stores none with their tokens
        for i, h in enumerate(hashes):
            keys = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            known = view.reported.get(h)
            extra = block_extra(keys, lora_name)
            if known is not None:  # another copy of a block already hashed (a duplicate, another tier)
                own = known[0]
            elif extra is None or (extra and view.native is False):
                # hashed with inputs the gateway never sees (vLLM's multimodal identifiers, a cache_salt; image
                # digests are Shoal's only from an engine hashing like the gateway): neither it nor its descendants
                own = None
            elif own_parent is not None and whole:
                own = block_hash(own_parent, tokens[i * bs:(i + 1) * bs], extra)
                view.native = own == h
            elif view.native:
                own = h  # the engine's hashes are the gateway's: no parent needed
            else:
                own = None
            if own is None:
                own_parent = None
                continue
            self._hold(view, h, own, medium)
            own_parent = own

    @staticmethod
    def _hold(view: EngineView, h: Reported, own: int, medium: str | None) -> None:
        entry = view.reported.get(h)
        if entry is None:
            view.reported[h] = [own, 1]
        else:
            entry[1] += 1
        media = view.blocks.setdefault(own, {})
        media[medium] = media.get(medium, 0) + 1

    @staticmethod
    def _release(view: EngineView, h: Reported, medium: str | None) -> None:
        entry = view.reported.get(h)
        if entry is None:
            return  # a block the view never held (stored before it started, or not hashable)
        own = entry[0]
        entry[1] -= 1
        if entry[1] <= 0:
            del view.reported[h]
        media = view.blocks[own]
        if medium not in media:  # removed from a medium it was never stored in: some copy went, say the last
            medium = next(reversed(media))
        if media[medium] > 1:
            media[medium] -= 1
        else:
            del media[medium]
            if not media:
                del view.blocks[own]

    def prompt_hashes(self, tokens: Sequence[int] | None, block_size: int | None, root: int = BASE_ROOT
                      ) -> list[int]:
        """The gateway's block hashes of a prompt's leading full blocks of `block_size` tokens from chain root
        `root` (none without a block size or without tokens); a kv_tokens.PromptTokens' image blocks with their images'
        digests, as the engine keys them."""
        if not tokens or not block_size:
            return []
        images = getattr(tokens, "images", ())
        keys = (lambda b: image_block_key(images, block_size, b)) if images else None
        return list(islice(hash_chain(tokens, block_size, parent=root, extra_keys=keys), self.max_blocks))

    def matches(self, urls: Iterable[str], tokens: Sequence[int] | None, adapter: str | None = None
                ) -> dict[str, int]:
        """Engine URL -> the number of leading blocks of the prompt `tokens` it holds, under LoRA adapter
        `adapter` (None: the base model); engines holding none are left out."""
        return {url: blocks for url, (blocks, _) in self.scores(urls, tokens, adapter).items()}

    def scores(self, urls: Iterable[str], tokens: Sequence[int] | None, adapter: str | None = None
               ) -> dict[str, tuple[int, float]]:
        """Engine URL -> (the leading blocks of the prompt it holds, their worth: each block at its best copy's
        weight, EngineView.weight), as `matches`."""
        chains: dict[tuple[int, int | None], list[int]] = {}  # (root, block size) -> the prompt's hashes
        out = {}
        for url in urls:
            view = self.views.get(url)
            if view is None or not view.blocks:
                continue
            if adapter is None:
                root = BASE_ROOT
            elif adapter in view.lora_roots:
                root = view.lora_roots[adapter]
            else:
                continue  # this engine never cached a block under the adapter
            key = (root, view.block_size)
            hashes = chains.get(key)
            if hashes is None:
                hashes = chains[key] = self.prompt_hashes(tokens, view.block_size, root)
            n, worth = 0, 0.0
            for h in hashes:
                if h not in view.blocks:
                    break
                n += 1
                worth += view.weight(h)
            if n:
                out[url] = (n, worth)
        return out
