"""Images of a chat request: OpenAI `image_url` content parts made the engine's ProcessedImage, off the event loop.

Only base64 `data:` URLs are taken. Fetching http(s) URLs is off (a later step adds it behind an allow-list of
domains with size and time caps); such a URL is a 400 that says so. Every failure here is a 400 before the engine
sees the request: a malformed part, a URL that is not a data URL, bad base64, more images than
--limit-mm-per-prompt, bytes that are not a whole image of a supported format, a text-only model.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from shoal.engine.server.protocol import APIError, ChatMessage


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The URL of every image_url content part, in conversation order (400 for a malformed part)."""
    urls = []
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
            urls.append(url)
    return urls


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data URL; 400 for anything else."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise APIError("fetching image URLs is off on this server: send the image inline as a base64 data URL "
                       "(data:image/png;base64,...)", 400, param="messages", code="image_url_fetch_disabled")
    if scheme != "data":
        raise APIError(f"image_url must be a base64 data URL (data:image/...;base64,...), got a {scheme or 'bare'!r} "
                       "URL", 400, param="messages")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise APIError("image_url data URLs must be base64 (data:image/...;base64,...)", 400, param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError("image_url: the data URL's payload is not valid base64", 400, param="messages") from None


async def chat_images(state: Any, messages: list[ChatMessage]) -> list | None:
    """The request's images processed for the model (None when it has none)."""
    urls = image_urls(messages)
    if not urls:
        return None
    images = state.engine.images
    if images is None:
        raise APIError(f"the model {state.served_model_name} takes text only: it cannot be given images", 400,
                       param="messages", code="images_not_supported")
    if len(urls) > images.limit:
        raise APIError(f"{len(urls)} images in one request is more than the limit of {images.limit} "
                       "(--limit-mm-per-prompt)", 400, param="messages")
    data = [decode_data_url(u) for u in urls]
    try:
        return await asyncio.to_thread(images.preprocess, data)
    except ValueError as e:  # core.images.ImageError: not an image, truncated, unsupported format
        raise APIError(str(e), 400, param="messages") from None
