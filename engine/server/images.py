"""Images of a request, made the engine's ProcessedImage off the event loop: a chat's OpenAI `image_url` content
parts, or a completions request's `multi_modal_data` (Shoal's extension: {"image": [{"url": ...}, ...]}, the
images in the order of the image placeholders written in its prompt).

Base64 `data:` URLs are always taken; http(s) URLs are fetched only from the hosts --allowed-media-domains lists
(server/media.py: size and time caps, SSRF checks), and are a 400 that says how to turn fetching on otherwise.
Every failure here is a 400 before the engine sees the request, naming the image (messages[i].content[j], or
multi_modal_data.image[i]): a malformed part, a URL that is neither, bad base64, a refused or failed fetch, more
images than --limit-mm-per-prompt, more pixels than --max-image-pixels, bytes that are not a whole image of a
supported format, a text-only model; for completions also a prompt whose placeholders do not match the images.
Chat and completions share every check below: only where the URLs come from differs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from shoal.engine.server.media import param_of
from shoal.engine.server.protocol import APIError, ChatMessage


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(where, url) of every image_url content part, in conversation order (400 for a malformed part); `where`
    names the part as messages[i].content[j]."""
    parts = []
    for m, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for i, part in enumerate(message.content):
            if part.get("type") != "image_url":
                continue
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise APIError(f"messages[{m}].content[{i}]: an image_url part needs {{\"image_url\": {{\"url\": "
                               "\"data:image/...;base64,...\"}}", 400, param="messages")
            parts.append((f"messages[{m}].content[{i}]", url))
    return parts


def multi_modal_parts(data: dict | None) -> list[tuple[str, str]]:
    """(where, url) of every image of a completions request's multi_modal_data, {"image": [{"url": ...}, ...]}
    (an entry may also be the URL itself, as an image_url part's may; one entry may stand for a list of one), in
    order; `where` names it as multi_modal_data.image[i]. 400 for another modality or a malformed entry."""
    if not data:
        return []
    other = sorted(k for k in data if k != "image")
    if other:
        raise APIError(f"multi_modal_data: only \"image\" is supported, got {', '.join(map(repr, other))}", 400,
                       param="multi_modal_data")
    entries = data.get("image")
    entries = [] if entries is None else entries if isinstance(entries, list) else [entries]
    parts = []
    for i, entry in enumerate(entries):
        url = entry.get("url") if isinstance(entry, dict) else entry
        if not isinstance(url, str) or not url:
            raise APIError(f"multi_modal_data.image[{i}]: an image needs {{\"url\": \"data:image/...;base64,...\"}}",
                           400, param="multi_modal_data")
        parts.append((f"multi_modal_data.image[{i}]", url))
    return parts


def url_scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""


def decode_data_url(url: str, where: str) -> bytes:
    """The bytes of a base64 data URL; 400 for anything else."""
    scheme = url_scheme(url)
    if scheme != "data":
        raise APIError(f"{where}: image_url must be a base64 data URL (data:image/...;base64,...) or an http(s) URL, "
                       f"got a {scheme or 'bare'!r} URL", 400, param=param_of(where))
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise APIError(f"{where}: image_url data URLs must be base64 (data:image/...;base64,...)", 400,
                       param=param_of(where))
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where}: the data URL's payload is not valid base64", 400, param=param_of(where)) from None


async def load_image(state: Any, where: str, url: str) -> bytes:
    """The encoded bytes of one image_url: inline, or fetched when the server fetches."""
    if url_scheme(url) in ("http", "https"):
        return await state.media.fetch(where, url)
    return decode_data_url(url, where)


async def load_images(state: Any, parts: list[tuple[str, str]]) -> list[bytes]:
    """Every part's bytes, fetched concurrently; the first failure cancels the rest and is the answer."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(load_image(state, where, url)) for where, url in parts]
    except BaseExceptionGroup as eg:
        first = next((e for e in eg.exceptions if isinstance(e, APIError)), eg.exceptions[0])
        raise first from None
    return [t.result() for t in tasks]


def _preprocess(images: Any, data: list[tuple[str, bytes]]) -> list:
    """The images processed one by one, so that an error names its part (runs off the event loop)."""
    out = []
    for where, encoded in data:
        try:
            out += images.preprocess([encoded])
        except ValueError as e:  # core.images.ImageError: not an image, truncated, unsupported format, too large
            raise APIError(f"{where}: {e}", 400, param=param_of(where), code=getattr(e, "code", None)) from None
    return out


def accepting(state: Any, parts: list[tuple[str, str]], param: str) -> Any:
    """The model's image path (core.images.ImageInputs), once it is known to take this many images."""
    images = state.engine.images
    if images is None:
        raise APIError(f"the model {state.served_model_name} takes text only: it cannot be given images", 400,
                       param=param, code="images_not_supported")
    if len(parts) > images.limit:
        raise APIError(f"{len(parts)} images in one request is more than the limit of {images.limit} "
                       "(--limit-mm-per-prompt)", 400, param=param)
    return images


async def processed(state: Any, images: Any, parts: list[tuple[str, str]]) -> list:
    """The parts loaded (inline or fetched) and processed for the model."""
    data = await load_images(state, parts)
    return await asyncio.to_thread(_preprocess, images, [(where, d) for (where, _), d in zip(parts, data)])


async def chat_images(state: Any, messages: list[ChatMessage]) -> list | None:
    """The chat request's images processed for the model (None when it has none)."""
    parts = image_parts(messages)
    if not parts:
        return None
    return await processed(state, accepting(state, parts, "messages"), parts)


async def completion_images(state: Any, data: dict | None, prompts: list[list[int]]) -> list | None:
    """A completions request's multi_modal_data processed for the model (None when it has none), once the prompt
    (its token ids) is known to hold one image placeholder per image: that is checked before anything is fetched.
    The images belong to one prompt, so a batch of prompts cannot have them."""
    parts = multi_modal_parts(data)
    if not parts:
        return None
    images = accepting(state, parts, "multi_modal_data")
    if len(prompts) != 1:
        raise APIError(f"multi_modal_data goes with one prompt, not a batch of {len(prompts)}: send one request a "
                       "prompt", 400, param="multi_modal_data")
    try:
        images.placeholders(prompts[0], len(parts))
    except ValueError as e:
        raise APIError(f"{e}: write the model's image placeholder {images.placeholder!r} in the prompt once for "
                       "each image of multi_modal_data, in order", 400, param="prompt",
                       code="image_placeholder_mismatch") from None
    return await processed(state, images, parts)
