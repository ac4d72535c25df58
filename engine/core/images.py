"""Images in prompts, for vision-language models (models/__init__.accepts_images: LLaVA-style, Qwen2.5-VL).

  ImageInputs      the model's own transformers processor (its image processor: the torchvision-backed one where
                   torchvision is installed, else the PIL one): decodes image bytes, makes pixel values, and places
                   the images in a prompt by expanding each image placeholder token to the image's token count
  QwenVLImageInputs  the same for Qwen2.5-VL (Qwen2VLImageProcessor: smart-resized, flattened patches and their
                   grid), which also gives each prompt its M-RoPE positions (`mrope_positions`)
  ProcessedImage   one image ready for the model: pixel values (and patch grid), token count, content digest
  PromptImages     a prompt's images at their token offsets: which image slice a step prefills (StepImage), each
                   KV block's extra hash key (the digests of the images whose tokens it holds; kv_hash), and for
                   M-RoPE models the prompt's 3-D positions and rope delta

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

from shoal.engine.kv_hash import image_block_key


class ImageError(ValueError):
    """An image the engine cannot take: the caller's 400 (`code`: the error body's code, where it has one)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    pixel_values: torch.Tensor  # [1, C, H, W] (LLaVA); [patches, C * t * p * p] (Qwen-VL)
    num_tokens: int
    digest: bytes  # sha256 of the pixel values' shape and bytes (and the patch grid)
    grid_thw: tuple[int, int, int] | None = None  # Qwen-VL: the patch grid (temporal, height, width)


@dataclass(eq=False)
class PromptImages:
    """A prompt's images, each at the offset of its first token (in prompt order)."""

    placed: list[tuple[int, ProcessedImage]]
    block_size: int
    # M-RoPE models: the prompt's positions [3, prompt length] (temporal, height, width), and the shift of every
    # position after the prompt (generated tokens are at their index + rope_delta, the three sets equal)
    positions: torch.Tensor | None = None
    rope_delta: int = 0
    # Gemma 3: an image's tokens attend to the whole image (both directions), so its tokens are prefilled in one
    # chunk (the scheduler never cuts inside an image) and the step carries the image's span (StepInputs.image_spans)
    bidirectional: bool = False

    def __post_init__(self):
        if self.positions is not None:
            self.prompt_len = self.positions.shape[1]
            self._row = self.positions[0].tolist()  # text positions: the three sets are equal

    def rope_row(self, start: int, end: int) -> list[int]:
        """Positions [start, end) as one row (exact for text and generated tokens; image tokens take `positions`)."""
        n = self.prompt_len
        if start >= n:
            return list(range(start + self.rope_delta, end + self.rope_delta))
        return self._row[start:min(end, n)] + list(range(n + self.rope_delta, end + self.rope_delta))

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

    def cut(self, start: int, n: int) -> int:
        """Bidirectional images: how many of the n tokens from `start` a chunk may take without ending inside an
        image (up to the image's first token, or 0 when the chunk starts inside it and cannot hold its rest)."""
        if not self.bidirectional:
            return n
        for offset, image in self.placed:
            if offset < start + n < offset + image.num_tokens:
                return max(0, offset - start)
        return n

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """(first position, end) of each image with tokens in [start, end)."""
        return [(a - first, a - first + image.num_tokens) for a, image, first, _ in self.slices(start, end)]

    def block_key(self, block: int) -> bytes:
        """Block `block`'s extra hash key: b"shoal-image" and the digest of each image with tokens in it, or b""."""
        return image_block_key(self.key_images, self.block_size, block)

    @property
    def key_images(self) -> list[tuple[int, int, bytes]]:
        """(offset, token count, digest) of each image: what keys the blocks (kv_hash), and /tokenize returns."""
        return [(offset, image.num_tokens, image.digest) for offset, image in self.placed]


class ImageInputs:
    """The image path of one served vision-language model."""

    # Formats PIL opens that a chat client sends; anything else is refused before it is decoded.
    FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    mrope = False  # the family places image tokens by 3-D positions (Qwen-VL's M-RoPE)

    def __init__(self, model_dir: Path, hf_config, limit: int, max_pixels: int = 4096 * 4096, tokenizer=None):
        self.token_id = int(hf_config.image_token_id)
        self.limit = limit
        self.max_pixels = max_pixels  # --max-image-pixels
        self._load(Path(model_dir), hf_config, tokenizer)
        self.placeholder = getattr(self, "placeholder", self.token)  # what a chat's image part becomes in the text

    def _load(self, model_dir: Path, hf_config, tokenizer) -> None:
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: the model takes images but its processor cannot be loaded ({e})") from None
        self.image_processor = self.processor.image_processor
        self.token = self.processor.image_token
        self.image_seq_length = int(hf_config.vl_config.get("image_seq_length") or 576)

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
            out.append(self._process(image))
        return out

    def _process(self, image) -> ProcessedImage:
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        return ProcessedImage(pixels, self._num_tokens(pixels), _digest(pixels))

    def _num_tokens(self, pixels: torch.Tensor) -> int:
        """The image's placeholder count, as the processor expands it (LlavaProcessor.replace_image_token)."""
        p = self.processor
        if getattr(p, "patch_size", None) is None:  # an older processor config: the model's fixed count
            return self.image_seq_length
        n = (pixels.shape[-2] // p.patch_size) * (pixels.shape[-1] // p.patch_size) + p.num_additional_image_tokens
        return n - 1 if p.vision_feature_select_strategy == "default" else n

    def placeholders(self, token_ids: list[int], num_images: int) -> list[int]:
        """Where the prompt's image placeholder tokens are; ImageError unless there is one per image (checked before
        any image is fetched or processed, by the server's completions path, and again as the prompt is placed)."""
        marks = [i for i, t in enumerate(token_ids) if t == self.token_id]
        if len(marks) != num_images:
            raise ImageError(f"the prompt has {len(marks)} image placeholder(s) {self.token!r} for {num_images} "
                             "image(s)")
        return marks

    def place(self, token_ids: list[int], images: list[ProcessedImage], block_size: int
              ) -> tuple[list[int], PromptImages]:
        """The prompt with each image placeholder token expanded to its image's tokens, and the images' places."""
        marks = self.placeholders(token_ids, len(images))
        out, placed, last = [], [], 0
        for mark, image in zip(marks, images):
            out += token_ids[last:mark]
            placed.append((len(out), image))
            out += [self.token_id] * image.num_tokens
            last = mark + 1
        out += token_ids[last:]
        return out, PromptImages(placed, block_size)


class QwenVLImageInputs(ImageInputs):
    """Qwen2.5-VL: each image smart-resized to multiples of patch * merge pixels and cut into flattened patches
    (Qwen2VLImageProcessor); its <|image_pad|> is expanded to grid_t * grid_h * grid_w / merge_size**2 tokens as
    Qwen2_5_VLProcessor.replace_image_token does; a chat's image part is <|vision_start|><|image_pad|><|vision_end|>,
    as Qwen's chat template writes it. Only the image processor is loaded (the whole processor also builds a video
    processor, which needs torchvision)."""

    mrope = True

    def _load(self, model_dir: Path, hf_config, tokenizer) -> None:
        from transformers import AutoImageProcessor

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: the model takes images but its image processor cannot be loaded "
                             f"({e})") from None
        self.merge = int(self.image_processor.merge_size)
        vl = hf_config.vl_config
        self.spatial_merge = int(vl["vision_config"]["spatial_merge_size"])
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        start, end = (tokenizer.convert_ids_to_tokens(int(vl[k])) for k in ("vision_start_token_id",
                                                                              "vision_end_token_id"))
        self.token = tokenizer.convert_ids_to_tokens(self.token_id)
        self.placeholder = start + self.token + end

    def _process(self, image) -> ProcessedImage:
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels, grid = out["pixel_values"], tuple(int(g) for g in out["image_grid_thw"][0])
        return ProcessedImage(pixels, grid[0] * grid[1] * grid[2] // self.merge ** 2, _digest(pixels, grid), grid)

    def place(self, token_ids: list[int], images: list[ProcessedImage], block_size: int
              ) -> tuple[list[int], PromptImages]:
        out, placed = super().place(token_ids, images, block_size)
        positions, delta = mrope_positions(len(out), placed.placed, self.spatial_merge)
        return out, PromptImages(placed.placed, block_size, positions, delta)


class Gemma3ImageInputs(ImageInputs):
    """Gemma 3: the checkpoint's Gemma3ImageProcessor (resized to its fixed size; pan-and-scan off) and
    Gemma3Processor's expansion: each <start_of_image> of the prompt becomes "\\n\\n" <start_of_image>, the
    image's mm_tokens_per_image <image_soft_token>s, <end_of_image> "\\n\\n" (its full_image_sequence), the
    newlines tokenized as the tokenizer writes them next to the text around (vLLM's merge of "\\n" runs). The image
    tokens attend to their whole image (PromptImages.bidirectional)."""

    bidirectional = True  # (a test turns it off to show what causal-only attention would compute)

    def _load(self, model_dir: Path, hf_config, tokenizer) -> None:
        super()._load(model_dir, hf_config, tokenizer)
        tok = self.processor.tokenizer
        self.token_id = int(tok.boi_token_id)  # the prompt's placeholder: <start_of_image>
        self.token = tok.boi_token
        self.image_token_id = int(hf_config.image_token_id)  # what it expands to
        self.eoi_token_id = int(tok.eoi_token_id)
        self.num_image_tokens = int(hf_config.vl_config["mm_tokens_per_image"])
        self.newlines = tok.encode("\n\n", add_special_tokens=False)
        vocab = tok.get_vocab()
        runs = [vocab.get("\n" * k) for k in range(1, 5)]
        self.merges = [] if None in runs else [([runs[0], runs[1]], runs[2]), ([runs[1], runs[0]], runs[2]),
                                              ([runs[1], runs[1]], runs[3])]

    def _process(self, image) -> ProcessedImage:
        pixels = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="pt")["pixel_values"]
        return ProcessedImage(pixels, self.num_image_tokens, _digest(pixels))

    def place(self, token_ids: list[int], images: list[ProcessedImage], block_size: int
              ) -> tuple[list[int], PromptImages]:
        marks = self.placeholders(token_ids, len(images))
        # text pieces around the placeholders, each with the newlines the expansion puts next to it
        pieces = [token_ids[a + 1:b] for a, b in zip([-1] + marks, marks + [len(token_ids)])]
        out, starts = [], []
        for i, (piece, image) in enumerate(zip(pieces, images)):
            out += _merge_newlines((self.newlines if i else []) + piece + self.newlines, self.merges)
            out.append(self.token_id)
            starts.append(len(out))
            out += [self.image_token_id] * image.num_tokens + [self.eoi_token_id]
        out += _merge_newlines((self.newlines if images else []) + pieces[-1], self.merges)
        return out, PromptImages(list(zip(starts, images)), block_size, bidirectional=self.bidirectional)


def _merge_newlines(ids: list[int], merges: list) -> list[int]:
    """Adjacent newline tokens joined into the one token the tokenizer writes for the run (Gemma's "\\n\\n\\n")."""
    for pair, joined in merges:
        i = 0
        while i + 1 < len(ids):
            if ids[i:i + 2] == pair:
                ids = ids[:i] + [joined] + ids[i + 2:]
            i += 1
    return ids


def mrope_positions(length: int, placed: list[tuple[int, ProcessedImage]], merge: int) -> tuple[torch.Tensor, int]:
    """A prompt's M-RoPE positions [3, length] and rope delta, as transformers' Qwen2_5_VLModel.get_rope_index: text
    tokens count on from the last position (the three sets equal); an image's tokens, at the current position s, are
    (s + t, s + row, s + column) over its merged grid, and the text after it continues at s + max(rows, columns). The
    delta is max + 1 - length (a generated token at index i is at i + delta)."""
    parts, pos, last = [], 0, 0
    for offset, image in placed:
        if offset > last:  # text before the image
            parts.append(torch.arange(offset - last).expand(3, -1) + pos)
            pos += offset - last
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        parts.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        last = offset + image.num_tokens
    if length > last:
        parts.append(torch.arange(length - last).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - length


def _digest(pixels: torch.Tensor, grid: tuple | None = None) -> bytes:
    """sha256 of the pixel values' shape and bytes (and the patch grid: the same patches in another grid differ)."""
    head = repr(tuple(pixels.shape)) + ("" if grid is None else repr(grid))
    return hashlib.sha256(head.encode() + pixels.contiguous().numpy().tobytes()).digest()


def image_inputs(model_dir: Path, hf_config, limit: int, max_pixels: int, tokenizer=None) -> ImageInputs:
    """The image path of the served vision-language model's family."""
    qwen = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
    family = getattr(hf_config, "vl_family", None)
    cls = (QwenVLImageInputs if family in qwen else Gemma3ImageInputs if family == "Gemma3ForConditionalGeneration"
           else ImageInputs)
    return cls(model_dir, hf_config, limit, max_pixels, tokenizer)
