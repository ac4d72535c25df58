"""A request's prompt as a chain of block hashes, computed from text alone (no tokenizer on the request path).

The engine's prefix cache keys each full KV block by a hash chained over every earlier block, so two requests
share cached blocks exactly as far as their prompts agree from the start. The gateway mirrors that on
characters: the rendered prompt is cut into fixed-size character blocks and block i's hash covers blocks 0..i.
Two prompts that agree on their first k blocks share their first k hashes, and only those. The hashes are
deterministic across processes (blake2b, not Python's salted `hash`), so several gateway replicas compute the
same chains. Only the first `max_blocks` blocks are hashed: that bounds the picker's cost on very long prompts
(a 220 KB prompt costs the same as a 16 KB one) while the first tens of KB are what decide affinity anyway.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Separators that cannot appear in ordinary text keep "role=user, content=ab" and "role=useraa, content=b" apart.
_FIELD = "\x1f"
_RECORD = "\x1e"


_IMAGE = "\x1d"  # leads an image's digest in the rendered text


def _image_text(part: dict) -> str | None:
    """An image_url part as a short digest of its URL (a data URL's bytes, or the address): the same picture in
    each turn of a conversation is the same text, another picture is other text, whatever the image's size (the
    base64 itself would fill the hashed blocks). None when the part has no URL."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        return None
    return f"{_IMAGE}image:{hashlib.blake2b(url.encode('utf-8', 'surrogatepass'), digest_size=8).hexdigest()}"


def _content_text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts joined, images by digest, others by
    type)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                image = _image_text(part) if part.get("type") == "image_url" else None
                parts.append(text if isinstance(text, str) else image or str(part.get("type", "")))
            else:
                parts.append(str(part))
        return "".join(parts)
    return str(content)


def render_prompt(path: str, body: Any) -> str | None:
    """The text whose prefix decides which engine's KV cache can serve this request; None when there is none.

    Chat messages are rendered as role + content records (close enough to any chat template: templates are
    applied per message in order, so a shared message prefix is a shared token prefix). The model name leads,
    because different models never share cache entries.
    """
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    head = (model if isinstance(model, str) else "") + _RECORD
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out = [head]
        for m in messages:
            if isinstance(m, dict):
                out.append(f"{m.get('role', '')}{_FIELD}{_content_text(m.get('content'))}{_RECORD}")
        return "".join(out)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            # A batch of prompts goes to one engine: route by the first. A token-id list is its own text.
            first = prompt[0]
            prompt = first if isinstance(first, (str, list)) else prompt
            if isinstance(prompt, list):
                prompt = ",".join(str(t) for t in prompt)
        if not isinstance(prompt, str):
            return None
        return head + prompt
    return None


def block_hashes(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """Chained 8-byte hashes of the full `block_chars`-character blocks of `text` (at most `max_blocks`)."""
    n = min(len(text) // block_chars, max_blocks)
    if n <= 0:
        return []
    data = text[: n * block_chars].encode("utf-8", "surrogatepass")
    if len(data) == n * block_chars:  # ASCII: character blocks are byte blocks, slice the bytes directly
        blocks = (data[i * block_chars:(i + 1) * block_chars] for i in range(n))
    else:
        blocks = (text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass") for i in range(n))
    running = hashlib.blake2b(digest_size=8)
    out = []
    for b in blocks:
        running.update(b)
        out.append(running.copy().digest())
    return out
