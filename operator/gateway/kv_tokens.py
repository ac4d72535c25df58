"""A completion request's prompt as the token ids its engine will see (precise-prefix routing), with the model's
own tokenizer (the `tokenizers` library: no torch, no transformers).

Only /v1/completions prompts: a string is encoded as the engine encodes it (special tokens added unless the
request says `add_special_tokens: false`), a token-id list is taken as is; a batch routes by its first prompt.
Chat requests return None here: their token ids depend on the chat template the engine renders, which this module
does not reproduce; the gateway asks an engine's /tokenize for them instead (proxy.prompt_tokens). A chat with
images comes back from a Shoal engine's /tokenize with each image's placement and content digest (the sha256 of
the pixel values its processor makes, which the gateway cannot compute from the image's bytes): PromptTokens
carries them to the index, which hashes the image blocks with them as the engine does (kv_index.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class PromptTokens(list):
    """A prompt's token ids and where its images sit: (offset, length, digest) per image, as an engine's /tokenize
    answers them, so its image blocks hash as the engine hashes them (kv_hash.image_block_key). A list, so it goes
    wherever a prompt's token ids go."""

    def __init__(self, tokens: Iterable[int], images: Sequence[tuple[int, int, bytes]] = ()):
        super().__init__(tokens)
        self.images = tuple(images)


def tokenized_images(answer: Any) -> list[tuple[int, int, bytes]]:
    """A Shoal /tokenize answer's `images` ([{"offset", "length", "digest": 64 hex}]) as (offset, length, digest);
    [] when absent (another runtime, or no image) or malformed: the prompt then hashes as text, which matches no
    image block (a cache hit lost at worst, never a wrong engine's)."""
    if not isinstance(answer, list):
        return []
    out = []
    for image in answer:
        try:
            offset, length, digest = image["offset"], image["length"], bytes.fromhex(image["digest"])
        except (TypeError, KeyError, ValueError):
            return []
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length > 0
                and len(digest) == 32):
            return []
        out.append((offset, length, digest))
    return out


def tokenizer_file(path: str) -> Path:
    """`path`: a tokenizer.json file, or a model / tokenizer directory holding one (ValueError: neither)."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there (a Hugging Face fast tokenizer's file)")
    return file


class PromptTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = tokenizer_file(path)
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - a corrupt file is a start-up error in words
            raise ValueError(f"--tokenizer {path}: cannot load {file}: {e}") from None

    def token_ids(self, path: str, body: Any) -> list[int] | None:
        if not path.endswith("/completions") or path.endswith("/chat/completions") or not isinstance(body, dict):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one engine: route by its first prompt
        if isinstance(prompt, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            return None
        if not isinstance(prompt, str) or not prompt:
            return None
        add_special = body.get("add_special_tokens", True)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special is not False).ids
