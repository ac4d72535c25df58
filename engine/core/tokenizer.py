"""Tokenizer loading (offline), chat templates, and incremental detokenization for streaming.

- `load_tokenizer` wraps transformers' AutoTokenizer with `local_files_only=True`: a local directory or a hub id
  already in the local HF cache; a clear `TokenizerLoadError` naming the path otherwise.
- `load_chat_template` resolves `--chat-template` (a file path, or an inline Jinja string like vLLM's);
  `render_chat` renders OpenAI-style messages with the tokenizer's template or that override, raising
  `ChatTemplateError` (a ValueError; the server answers 400) when there is no template or rendering fails.
- `IncrementalDetokenizer` turns generated token ids into text deltas that are safe to stream: never a partial
  UTF-8 character, never text that may still become part of a stop string; stop strings spanning token
  boundaries are found and the text trimmed. Work per step is proportional to the new tokens (a sliding
  prefix/read window like vLLM's), not to the whole output.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Files any of which makes a directory a tokenizer directory for AutoTokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


class TokenizerLoadError(ValueError):
    """The tokenizer could not be loaded; the message names the path or id."""


class ChatTemplateError(ValueError):
    """No chat template, an unreadable --chat-template, or a template that failed to render (a 400 for clients)."""


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(path_or_id: str | os.PathLike, revision: str | None = None, trust_remote_code: bool = False,
                   **kwargs: Any):
    """Load a Hugging Face tokenizer from a local directory or the local HF cache; never touches the network."""
    from transformers import AutoTokenizer

    name = str(path_or_id)
    p = Path(name).expanduser()
    if p.is_file():
        from shoal.engine.execution.gguf_model import is_gguf, load_gguf_tokenizer

        if not is_gguf(p):
            raise TokenizerLoadError(f"tokenizer path {str(p)!r} is neither a directory nor a GGUF file")
        try:
            return load_gguf_tokenizer(p, **kwargs)
        except Exception as e:  # noqa: BLE001 - the converter raises many types for unsupported vocabularies
            raise TokenizerLoadError(f"could not load the tokenizer stored in {str(p)!r}: {e}") from e
    if p.exists():
        if not p.is_dir():
            raise TokenizerLoadError(f"tokenizer path {str(p)!r} is not a directory")
        present = [f for f in TOKENIZER_FILES if (p / f).is_file()]
        if not present:
            raise TokenizerLoadError(
                f"no tokenizer files in {str(p)!r}: expected tokenizer.json or tokenizer_config.json (with "
                f"vocab.json + merges.txt, tokenizer.model or vocab.txt)"
            )
        name = str(p)
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not a hub id (org/name)
        raise TokenizerLoadError(f"tokenizer directory {name!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... depending on what is missing
        where = (
            f"directory {name!r}" if p.exists()
            else f"{name!r} (not a local directory, and not in the local Hugging Face cache; no network access is used)"
        )
        raise TokenizerLoadError(f"could not load a tokenizer from {where}: {e}") from e
    return tok


def get_eos_token_ids(tokenizer, model_dir: str | os.PathLike | None = None) -> set[int]:
    """The ids that end generation: the tokenizer's eos plus generation_config.json's eos_token_id (int or list)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        gc = Path(model_dir) / "generation_config.json"
        if gc.is_file():
            try:
                eos = json.loads(gc.read_text()).get("eos_token_id")
            except (OSError, ValueError):
                eos = None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos if isinstance(e, int))
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Chat templates

NO_CHAT_TEMPLATE_HINT = (
    "pass one with --chat-template FILE (a Jinja template file, or the template inline)"
)


def load_chat_template(arg: str | os.PathLike | None) -> str | None:
    """Resolve --chat-template: a file path (a .jinja/.j2 file, or a JSON file with a "chat_template" key such as
    a tokenizer_config.json), or an inline Jinja string (anything containing '{', '}' or a newline, like
    vLLM). None stays None. Raises ChatTemplateError for an unreadable file or a template that does not parse."""
    if arg is None:
        return None
    s = os.fspath(arg)
    p = Path(s).expanduser()
    template: str
    is_inline = isinstance(arg, str) and any(c in s for c in "{}\n")
    if not is_inline:
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ChatTemplateError(
                f"--chat-template {s!r} looks like a file path, but it cannot be read: {e.strerror or e}"
            ) from e
        if p.suffix == ".json":
            try:
                data = json.loads(text)
            except ValueError as e:
                raise ChatTemplateError(f"--chat-template file {s!r} is not valid JSON: {e}") from e
            t = data.get("chat_template") if isinstance(data, dict) else None
            if isinstance(t, list):  # tokenizer_config.json's list of named templates: take "default"
                t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
            if not isinstance(t, str):
                raise ChatTemplateError(f"--chat-template file {s!r} has no \"chat_template\" string")
            template = t
        else:
            template = text
    else:
        template = s
        if "\n" not in s and "\\n" in s and s.isascii():
            # typed on a command line: interpret escapes like "\n" as vLLM does
            template = codecs.decode(s, "unicode_escape")
    if not template.strip():
        raise ChatTemplateError(f"--chat-template {s!r} is empty")
    _check_template_syntax(template, s)
    return template


def _check_template_syntax(template: str, origin: str) -> None:
    try:
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with transformers' chat template support
        return
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        where = "inline template" if len(origin) > 80 or "{" in origin else repr(origin)
        raise ChatTemplateError(f"--chat-template {where} is not a valid Jinja template: {e.message} (line {e.lineno})") from e


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _normalise_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        m = dict(m)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: only text content parts are supported, got {kind!r}"
                    )
            m["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        out.append(m)
    return out


def render_chat(tokenizer, messages: Any, *, chat_template: str | None = None, add_generation_prompt: bool = True,
                **kwargs: Any) -> str:
    """Render messages to the prompt string with `chat_template` (already resolved, e.g. by load_chat_template)
    or else the tokenizer's own template. Raises ChatTemplateError when there is neither or rendering fails."""
    if chat_template is None and not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", None) or "the model"
        raise ChatTemplateError(f"the tokenizer of {name} has no chat template; {NO_CHAT_TEMPLATE_HINT}")
    msgs = _normalise_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            msgs, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates, undefined names), TypeError, ...
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise ChatTemplateError(f"chat template rendering returned {type(text).__name__}, not a string")
    return text


# ---------------------------------------------------------------------------------------------------------------
# Incremental detokenization

_INITIAL_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space handling of SentencePiece)
_MAX_PENDING_TOKENS = 256  # a window still ending in U+FFFD after this many tokens is released as is (garbage)
_COMPACT_AT = 1024  # drop consumed ids from the window buffer past this many


def _make_decoder(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """ids -> text, as tokenizer.decode(ids, skip_special_tokens=...) without clean-up of tokenization spaces."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover
        Tokenizer = None  # type: ignore[assignment]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if Tokenizer is not None and isinstance(backend, Tokenizer):
        # Fast tokenizers: straight to Rust (what transformers' decode does, minus Python overhead).
        # spaces_between_special_tokens has no effect on fast tokenizers, as in transformers.
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode

    def decode_slow(ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
                                    spaces_between_special_tokens=spaces_between_special_tokens)
        except TypeError:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return decode_slow


class IncrementalDetokenizer:
    """Streams the text of one sequence's generated tokens.

    `append(ids)` returns the text newly safe to show; `text` is everything shown so far. When a stop string
    matches, `stop_string` is set, `text` ends just before it (or just after it with
    include_stop_str_in_output) and later appends return "". When the sequence ends for any other reason,
    `flush()` returns the text still held back (a possible stop-string prefix, an incomplete character).

    Stop tokens (EOS, stop_token_ids) are the engine's business: like vLLM, do not append the token that ended
    the sequence unless you want its text (with skip_special_tokens=True an EOS decodes to nothing anyway).
    Stop strings are only looked for once more than `min_tokens` tokens exist (vLLM's rule).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 stop: Sequence[str] | None = None, include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0):
        self._decode = _make_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        ctx = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:]) if len(prompt_token_ids) else []
        prefix_text = self._decode(ctx) if ctx else ""
        if prefix_text.endswith("\ufffd"):
            # The prompt ends inside a character: a diff against it would be off; decode the output on its own.
            ctx, prefix_text = [], ""
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = prefix_text
        self._extra = 0  # characters past prefix_text already released while the window ends in U+FFFD
        self._pending = ""  # decoded text held back (a possible stop-string prefix)
        self._chunks: list[str] = []
        self.num_output_tokens = 0
        self.stop_string: str | None = None

    @classmethod
    def from_params(cls, tokenizer, prompt_token_ids: Sequence[int], params) -> "IncrementalDetokenizer":
        """Built from a SamplingParams."""
        return cls(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   min_tokens=params.min_tokens)

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    # ------------------------------------------------------------------------------------------------------
    def append(self, token_ids: Sequence[int] | int) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if self.stop_string is not None:
            return ""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        delta = self._decode_step(final=False)
        return self._release(delta)

    def flush(self) -> str:
        """Release everything held back (the sequence ended for a reason other than a stop string)."""
        if self.stop_string is not None:
            return ""
        delta = self._decode_step(final=True)
        out = self._pending + delta
        self._pending = ""
        if out:
            self._chunks.append(out)
        return out

    # ------------------------------------------------------------------------------------------------------
    def _decode_step(self, final: bool) -> str:
        """Text of the tokens past the read offset that is complete UTF-8; advances the window when all is.

        Byte-level BPE (and SentencePiece byte fallback) decode an incomplete character to U+FFFD. While the
        window's text ends with U+FFFD, only the text before that trailing run is released (it can no longer
        change: lossy UTF-8 decoding is local), and the window is kept so the character can complete.
        """
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset:])
        start = len(self._prefix_text) + self._extra
        if (new_text.endswith("\ufffd") and not final
                and len(self._ids) - self._read_offset <= _MAX_PENDING_TOKENS):
            stable = len(new_text.rstrip("\ufffd"))
            if stable <= start:
                return ""
            self._extra += stable - start
            return new_text[start:stable]
        delta = new_text[start:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._extra = 0
        if self._prefix_offset > _COMPACT_AT:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return delta

    def _release(self, delta: str) -> str:
        if not delta:
            return ""
        if not self._stop or self.num_output_tokens <= self._min_tokens:
            out = self._pending + delta
            self._pending = ""
            self._chunks.append(out)
            return out
        buf = self._pending + delta
        # A match can only start inside the held-back text or the new delta (held text is always shorter than
        # the stop strings, so buf is short apart from the delta itself).
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = buf.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = buf[: i + len(s)] if self._include_stop else buf[:i]
            self._pending = ""
            self.stop_string = s
            if out:
                self._chunks.append(out)
            return out
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        out = buf[: len(buf) - hold]
        self._pending = buf[len(buf) - hold:]
        if out:
            self._chunks.append(out)
        return out
