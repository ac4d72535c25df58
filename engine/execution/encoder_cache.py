"""The vision encoder's outputs kept by image content (vision-language models; runner.ModelRunner._embed_images)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """The encoder outputs of the most recently used images, by content digest: an image's features are computed
    once for all the chunks its tokens are prefilled in, and again only after `capacity` other images pushed them
    out (a multi-turn conversation about one image encodes it once)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._features: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the vision tower (the cache's misses)

    def get(self, digest: bytes) -> torch.Tensor | None:
        features = self._features.get(digest)
        if features is not None:
            self._features.move_to_end(digest)
        return features

    def put(self, digest: bytes, features: torch.Tensor) -> None:
        self.encoded += 1
        self._features[digest] = features
        while len(self._features) > self.capacity:
            self._features.popitem(last=False)

    def clear(self) -> None:
        """Forget every image (a benchmark's "no cache" side)."""
        self._features.clear()
