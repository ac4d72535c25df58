"""A completion request's prompt as the token ids its engine will see (precise-prefix routing), with the model's
own tokenizer (the `tokenizers` library: no torch, no transformers).

Only /v1/completions prompts: a string is encoded as the engine encodes it (special tokens added unless the
request says `add_special_tokens: false`), a token-id list is taken as is; a batch routes by its first prompt.
Chat requests return None here: their token ids depend on the chat template the engine renders, which this module
does not reproduce; the gateway asks an engine's /tokenize for them instead (proxy.prompt_tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
