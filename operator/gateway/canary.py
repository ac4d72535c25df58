"""The traffic split between a service's stable and canary revisions (spec.canary), sticky per conversation.

Each request gets a revision before it is admitted: a hash of its conversation key, read as a number in [0, 100),
below the canary's share means the canary. Every request of a conversation has the same key, so a multi-turn
conversation stays on one revision (its KV prefix, and the answers' style, with it), every gateway replica decides
the same without sharing state, and over many conversations the canary's share is exactly the configured percent in
expectation. The key is, first found:

1. the `X-Session-Id` header (or `X-Shoal-Session`): a client that names its conversations;
2. chat: the messages up to and including the first user message (the system prompt and the opening question,
   which every later turn repeats); two conversations opening alike share a revision;
3. completions: the first PROMPT_KEY_CHARS characters of the prompt (a growing prompt keeps them). Prompts that all
   start with one long template share a revision: send a session header for an even split then.

The pool then routes among that revision's engines only, and among the other revision's when it has none that may
take requests (a canary scaled away, or not ready yet): a split never refuses a request.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from shoal.operator.contract import CANARY, STABLE

SESSION_HEADERS = ("X-Session-Id", "X-Shoal-Session")
PROMPT_KEY_CHARS = 512


def conversation_key(headers: Mapping[str, str], parsed: Any) -> bytes:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return b"session:" + value.encode()
    if isinstance(parsed, dict):
        messages = parsed.get("messages")
        if isinstance(messages, list):
            first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                              len(messages) - 1)
            opening = messages[:first_user + 1]
            return b"chat:" + json.dumps(opening, sort_keys=True, separators=(",", ":"), default=str).encode()
        prompt = parsed.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return b"prompt:" + prompt[:PROMPT_KEY_CHARS].encode()
        if isinstance(prompt, list):  # token ids
            return b"tokens:" + json.dumps(prompt[:PROMPT_KEY_CHARS]).encode()
    return b""


def revision_for(key: bytes, canary_percent: float) -> str:
    """The revision of a conversation: canary when its key's hash, read as a point of [0, 100), falls below the
    canary's share."""
    if canary_percent <= 0:
        return STABLE
    if canary_percent >= 100:
        return CANARY
    point = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64 * 100
    return CANARY if point < canary_percent else STABLE
