"""Images in prompts, for vision-language models (LLaVA-style: models/__init__.accepts_images).

  ImageInputs      the model's own transformers processor (its image processor: the torchvision-backed one where
                   torchvision is installed, else the PIL one): decodes image bytes, makes pixel values, and places
                   the images in a prompt by expanding each image placeholder token to the image's token count
  ProcessedImage   one image ready for the model: pixel values, token count, content digest
  PromptImages     a prompt's images at their token offsets: which image slice a step prefills (StepImage), and
                   each KV block's extra hash key (the digests of the images whose tokens it holds; kv_hash)

The digest is the sha256 of the pixel values the model sees (shape and bytes), so the same picture under the same
processor settings is the same image to the encoder cache and the prefix cache. PIL is imported only here, on the
image path.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch


class ImageError(ValueError):
    """An image the engine cannot take: the caller's 400 (`code`: the error body's code, where it has one)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    pixel_values: torch.Tensor  # [1, C, H, W]
    num_tokens: int
    digest: bytes  # sha256 of the pixel values' shape and bytes


@dataclass(eq=False)
class PromptImages:
    """A prompt's images, each at the offset of its first token (in prompt order)."""

    placed: list[tuple[int, ProcessedImage]]
    block_size: int

    @property
    def end(self) -> int:
        """One past the last image token."""
        offset, image = self.placed[-1]
        return offset + image.num_tokens

    def slices(self, start: int, end: int):
        """(offset of the first image token in [start, end), image, first, last + 1 of its tokens) for each image with
        tokens in positions [start, end)."""
        for offset, image in self.placed:
            a, b = max(start, offset), min(end, offset + image.num_tokens)
            if a < b:
                yield a, image, a - offset, b - offset

    def block_key(self, block: int) -> bytes:
        """Block `block`'s extra hash key: b"shoal-image" and the digest of each image with tokens in it, or b""."""
        start = block * self.block_size
        digests = [image.digest for _, image, _, _ in self.slices(start, start + self.block_size)]
        return b"shoal-image" + b"".join(digests) if digests else b""


class ImageInputs:
    """The image path of one served vision-language model."""

    # Formats PIL opens that a chat client sends; anything else is refused before it is decoded.
    FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

    def __init__(self, model_dir: Path, hf_config, limit: int, max_pixels: int = 4096 * 4096):
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: the model takes images but its processor cannot be loaded ({e})") from None
        self.image_processor = self.processor.image_processor
        self.token_id = int(hf_config.image_token_id)
        self.token = self.processor.image_token
        self.image_seq_length = int(hf_config.llava_config.get("image_seq_length") or 576)
        self.limit = limit
        self.max_pixels = max_pixels  # --max-image-pixels

    def decode(self, data: bytes):
        """A PIL image (RGB) from encoded bytes; ImageError when they are not a whole image of a known format."""
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data), formats=self.FORMATS)  # reads the header only
            self.check_pixels(image)  # before the pixels are decoded: a small file can hold a huge image
            image.load()  # decode now: a truncated file fails here, not later inside the processor
        except ImageError:  # over --max-image-pixels
            raise
        except Image.DecompressionBombError as e:  # PIL's own cap on pixels (a small file that decodes huge)
            raise ImageError(f"the image has too many pixels: {e}") from None
        except UnidentifiedImageError:
            raise ImageError(f"the image is not one of the supported formats ({', '.join(self.FORMATS)}) or is "
                             "corrupt") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"the image cannot be decoded (corrupt or truncated): {e}") from None
        return image.convert("RGB")

    def check_pixels(self, image) -> None:
        """ImageError when a PIL image (opened, not necessarily decoded) has more pixels than --max-image-pixels."""
        width, height = image.size
        if width * height > self.max_pixels:
            raise ImageError(f"the image is {width}x{height} = {width * height} pixels, more than the budget of "
                             f"{self.max_pixels} pixels per image (--max-image-pixels)", code="image_too_many_pixels")

    def preprocess(self, images: list) -> list[ProcessedImage]:
        """PIL images, or encoded bytes, made the model's inputs (pixel values, token count, digest)."""
        if len(images) > self.limit:
            raise ImageError(f"{len(images)} images in one prompt is more than the limit of {self.limit} "
                             "(--limit-mm-per-prompt)")
        out = []
        for image in images:
            if isinstance(image, ProcessedImage):
                out.append(image)
                continue
            if isinstance(image, (bytes, bytearray)):
                image = self.decode(bytes(image))
            else:
                self.check_pixels(image)
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
            digest = hashlib.sha256(repr(tuple(pixels.shape)).encode() + pixels.contiguous().numpy().tobytes())
            out.append(ProcessedImage(pixels, self._num_tokens(pixels), digest.digest()))
        return out

    def _num_tokens(self, pixels: torch.Tensor) -> int:
        """The image's placeholder count, as the processor expands it (LlavaProcessor.replace_image_token)."""
        p = self.processor
        if getattr(p, "patch_size", None) is None:  # an older processor config: the model's fixed count
            return self.image_seq_length
        n = (pixels.shape[-2] // p.patch_size) * (pixels.shape[-1] // p.patch_size) + p.num_additional_image_tokens
        return n - 1 if p.vision_feature_select_strategy == "default" else n

    def place(self, token_ids: list[int], images: list[ProcessedImage], block_size: int
              ) -> tuple[list[int], PromptImages]:
        """The prompt with each image placeholder token expanded to its image's tokens, and the images' places."""
        marks = [i for i, t in enumerate(token_ids) if t == self.token_id]
        if len(marks) != len(images):
            raise ImageError(f"the prompt has {len(marks)} image placeholder(s) {self.token!r} for {len(images)} "
                             "image(s)")
        out, placed, last = [], [], 0
        for mark, image in zip(marks, images):
            out += token_ids[last:mark]
            placed.append((len(out), image))
            out += [self.token_id] * image.num_tokens
            last = mark + 1
        out += token_ids[last:]
        return out, PromptImages(placed, block_size)
